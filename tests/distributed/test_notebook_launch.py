"""`notebook_launch` (parallel/launch/notebook.py): every case of the registry started as children of
the test process, as a notebook starts them (spawned, the function carried by dill by value), the
same losses as one
process on the global batch; a failing rank raises here, naming it, and ends the others."""

import matrix
import pytest
import torch
from harness import needs_both

from parallel import notebook_launch

pytestmark = pytest.mark.distributed
BUDGET_S = 60  # seconds in make test (tests/conftest.py)

# the launch environment is the backend's (registry: launch.env): make test starts one default
# variant per environment (FSDP2 and ZeRO-3 launch alike: FSDP2's stands for both; the engines
# are the same as under torchrun), make test-full every variant (matrix.py's tiers)
CASES = matrix.cases(world=2, micro_batch_size=2)
if not matrix.FULL:
    CASES = [c for i, c in enumerate(CASES) if c.launch not in {d.launch for d in CASES[:i]}]
STEPS = 2


def train(spec, fail_rank=None):
    """What a notebook cell defines: build an engine from the spec it is given, take two steps."""
    from parallel import create_engine
    from parallel.toy import build_llama, llama_config

    engine = create_engine(spec)
    torch.manual_seed(0)
    engine.prepare(build_llama(llama_config("tiny")), (torch.optim.AdamW, {"lr": 1e-2}))
    if engine.rank == fail_rank:
        raise ValueError("a mistake in the cell")
    g, rows, losses = torch.Generator().manual_seed(1), engine.samples_per_step, []
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (rows * engine.dp_size, 16), generator=g)
        part = ids[engine.dp_rank * rows:(engine.dp_rank + 1) * rows]
        losses.append(engine.train_step({"input_ids": part, "labels": part}).loss)
    engine.close()
    return losses


def one_process() -> list:
    from parallel.toy import build_llama, llama_config

    torch.manual_seed(0)
    model = build_llama(llama_config("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g, losses = torch.Generator().manual_seed(1), []
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (4, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@needs_both
@pytest.mark.timeout(600)
def test_every_backend_launches_from_a_notebook(monkeypatch):
    expected = one_process()  # autograd has run here, as in a notebook: the ranks are spawned
    runs = {}
    for case in CASES:
        for key, value in case.env.items():
            monkeypatch.setenv(key, value)
        runs[case.name] = notebook_launch(train, case.spec, timeout=240)
    for case in CASES:
        results = runs[case.name]
        assert len(results) == case.nproc, case.name
        for losses in results:
            assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-5, (case.name, losses,
                                                                             expected)


@pytest.mark.timeout(300)
def test_a_failing_rank_is_named_and_the_others_end():
    spec = {"backend": "fsdp", "micro_batch_size": 2, "topology": {"procs_per_node": 2}}
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*a mistake in the cell"):
        notebook_launch(train, spec, 1, timeout=240)


@pytest.mark.timeout(300)
def test_a_script_without_a_main_guard(tmp_path):
    """A function defined in __main__ (a notebook cell, or a script) reaches the ranks by value, and
    the script is not run again in them (no `if __name__ == "__main__":` needed)."""
    import subprocess
    import sys

    from harness import ROOT

    script = tmp_path / "job.py"
    script.write_text(
        "import parallel, torch\n"
        "def job(spec, scale):\n"
        "    from parallel import create_engine\n"
        "    engine = create_engine(spec)\n"
        "    return engine.rank * scale\n"
        "print('ran', parallel.notebook_launch(job, {'backend': 'fsdp', 'topology': "
        "{'procs_per_node': 2}}, 10, timeout=200))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=280, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                            "OMP_NUM_THREADS": "1"})
    assert proc.stdout.count("ran [") == 1 and "ran [0, 10]" in proc.stdout, proc.stderr[-3000:]


def test_refusals_before_any_process_starts():
    with pytest.raises(ValueError, match="nodes is 2"):
        notebook_launch(train, {"backend": "fsdp", "topology": {"nodes": 2}})
