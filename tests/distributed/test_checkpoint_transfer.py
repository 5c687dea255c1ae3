"""Save under one backend, resume under another, for the registry's variants (FSDP2, FSDP1, ZeRO-1/2/3,
XLA v1 at world size 1, XLA v2 on 2 devices, and any added): with AdamW (moments and step counts) and
with SGD-momentum, each a cycle in which every backend is once the source and once the target of
another (make test), and with AdamW every ordered pair (make test-full). 3 steps on A, save, load on B
(from other initial weights), 2 more steps: fp32 losses within 1e-5 of one uninterrupted single-process
run, so weights, momentum, Adam moments and step counts all survived the move. World size changes
2 -> 1 and 1 -> 2 happen on the way (XLA v1, and FSDP2 launched on one rank).

Launches are grouped (matrix.by_launch): one torchrun per phase for the torch backends, one process
per XLA mode."""

import dataclasses
import json

import matrix
import pytest
from harness import ROOT, needs_both, torchrun
from shared import job, read

pytestmark = pytest.mark.distributed
BUDGET_S = 30  # seconds in make test (tests/conftest.py)

WORKER = ROOT / "tests" / "distributed" / "transfer_worker.py"
# Every variant in the registry (tests/distributed/matrix.py) is a source and a target, ZeRO-0 included.
CASES = matrix.cases(world=2, micro_batch_size=2, every=True)
SOURCES = [c.name for c in CASES]
# one rank of the first variant: loads the 2-rank checkpoints (2 -> 1), and XLA v1's (1 -> 1)
ONE = matrix.cases(world=1, micro_batch_size=4, every=True)[0]
ONE = dataclasses.replace(ONE, name=f"{ONE.name}_w1")
BACKENDS = {c.name: c.spec for c in [*CASES, ONE]}
LAUNCHES = matrix.by_launch([*CASES, ONE])  # one launch per group of cases that launch alike
# SGD's state is one momentum buffer per parameter, moved by the same code as Adam's moments: a
# cycle covers it (each target loads the next source's). AdamW: every variant is once a source and
# once a target of another (a cycle the other way round) in make test, every pair in make test-full.
SGD_SOURCE = {target: SOURCES[(i + 1) % len(SOURCES)] for i, target in enumerate(BACKENDS)}
ADAMW_SOURCES = {
    "cycle": {target: [SOURCES[(i - 1) % len(SOURCES)]] for i, target in enumerate(BACKENDS)},
    "pairs": {target: SOURCES for target in BACKENDS}}


def plan_for(tier: str) -> dict:
    return {target: [f"{s}-adamw" for s in ADAMW_SOURCES[tier][target]] +
            [f"{SGD_SOURCE[target]}-sgd"] for target in BACKENDS}


def worker_args(tmp, phase, names) -> list:
    return ["--phase", phase, "--backends", tmp / "backends.json", "--names", ",".join(names),
            "--root", tmp / "ckpt", "--out", tmp / f"{phase}-{names[0]}.json",
            "--plan", tmp / "plan.json"]


def launches(tmp, tier):
    """(phase, group, the worker's arguments): the sources save, then every target loads."""
    (tmp / "backends.json").write_text(json.dumps(BACKENDS))
    (tmp / "plan.json").write_text(json.dumps(plan_for(tier)))
    (tmp / "ckpt").mkdir()
    out = []
    for group in LAUNCHES:
        sources = [c.name for c in group if c.name in SOURCES]
        if sources:
            out.append((1, group, worker_args(tmp, "save", sources)))
    out += [(2, group, worker_args(tmp, "load", [c.name for c in group])) for group in LAUNCHES]
    return out


def shared_jobs(tmp):
    """make test's cycle, in the suite's shared launches (shared.py)."""
    return [job("transfer_worker", args, group[0].nproc, group[0].env, phase)
            for phase, group, args in launches(tmp, "cycle")]


@pytest.fixture(scope="module", params=["cycle", pytest.param("pairs", marks=pytest.mark.full)])
def matrix(tmp_path_factory, request):
    if request.param == "cycle":
        tmp_path, run = request.getfixturevalue("shared")[__name__]
    else:  # make test-full: every pair, launches of its own
        tmp_path, run = tmp_path_factory.mktemp("transfer-pairs"), None
        for _, group, args in launches(tmp_path, "pairs"):
            torchrun(group[0].nproc, [str(WORKER), *map(str, args)], timeout=400, env=group[0].env)
    saved, loaded = {}, {}
    for group in LAUNCHES:
        names = [c.name for c in group]
        sources = [n for n in names if n in SOURCES]
        if sources:
            saved.update(read(tmp_path / f"save-{sources[0]}.json", run, "transfer_worker"))
        loaded.update(read(tmp_path / f"load-{names[0]}.json", run, "transfer_worker"))
    return tmp_path, saved, loaded, request.param


@needs_both
@pytest.mark.timeout(1200)
def test_every_pair_resumes_with_the_uninterrupted_losses(matrix):
    _, saved, loaded, tier = matrix
    errors = {k: v["error"] for k, v in {**saved, **loaded}.items() if "error" in v}
    assert not errors, "\n\n".join(f"{k}:\n{v[-3000:]}" for k, v in errors.items())

    worst, pairs = 0.0, 0
    for opt in ("sgd", "adamw"):
        ref = saved[f"reference-{opt}"]["loss"]
        for source in SOURCES:
            before = saved[f"{source}-{opt}"]["loss"]
            assert max(abs(a - b) for a, b in zip(before, ref[:3])) <= 1e-5, (source, opt, before)
            for target in ([t for t in BACKENDS if source in ADAMW_SOURCES[tier][t]]
                           if opt == "adamw" else [t for t in BACKENDS if SGD_SOURCE[t] == source]):
                res = loaded[f"{source}->{target}-{opt}"]
                assert res["start"] == 3, (source, target, res)
                diff = max(abs(a - b) for a, b in zip(res["loss"], ref[3:]))
                assert diff <= 1e-5, f"{source} -> {target} ({opt}): {res['loss']} vs {ref[3:]}"
                worst, pairs = max(worst, diff), pairs + 1
    assert pairs == sum(len(s) for s in ADAMW_SOURCES[tier].values()) + len(BACKENDS)
    assert {s for sources in ADAMW_SOURCES[tier].values() for s in sources} == set(SOURCES)
    assert set(SGD_SOURCE.values()) == set(SOURCES) and all(SGD_SOURCE[s] != s for s in SOURCES)
    print(f"{pairs} transfers, max |loss - uninterrupted| = {worst:.2e}")


@needs_both
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("source", ["zero3", "xla2"])
def test_hf_export_of_a_saved_run_gives_the_same_loss_in_transformers(matrix, source):
    """The config saved with a Hugging Face model makes the export stand alone."""
    import subprocess
    import sys

    import torch
    from parity_worker import global_batches
    from transformers import AutoModelForCausalLM

    tmp, saved, _, _ = matrix
    out = subprocess.run([sys.executable, "-m", "parallel.cli", "ckpt", "export", "--to", "hf",
                          str(tmp / "ckpt" / f"{source}-adamw"), str(tmp / f"hf-{source}")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp / f"hf-{source}", torch_dtype=torch.float32)
    ids = global_batches(5, 1, 4)[3]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert abs(loss - saved["reference-adamw"]["loss"][3]) <= 1e-5
