"""Save under one backend, resume under another: every ordered pair of FSDP2, FSDP1, ZeRO-1/2/3, XLA v1
(world size 1) and XLA v2 (2 devices) with AdamW (moments and step counts), and with SGD-momentum a
cycle in which every backend is once the source and once the target. 3 steps on A, save, load on B
(from other initial weights), 2 more steps: fp32 losses within 1e-5 of one uninterrupted single-process
run, so weights, momentum, Adam moments and step counts all survived the move. World size changes
2 -> 1 and 1 -> 2 happen on the way (XLA v1, and FSDP2 launched on one rank).

Launches are grouped: one torchrun per phase for the torch backends, one process per XLA mode."""

import json

import pytest
from harness import ROOT, torchrun, needs_both

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "distributed" / "transfer_worker.py"
TWO = {"topology": {"procs_per_node": 2}, "micro_batch_size": 2}
BACKENDS = {
    "fsdp2": {"backend": "fsdp", **TWO},
    "fsdp1": {"backend": "fsdp", "fsdp": {"version": 1}, **TWO},
    "zero1": {"backend": "deepspeed", "shard": "optimizer", **TWO},
    "zero2": {"backend": "deepspeed", "shard": "grad_op", **TWO},
    "zero3": {"backend": "deepspeed", "shard": "full", **TWO},
    "xla1": {"backend": "xla_fsdp", "micro_batch_size": 4, "xla": {"fsdp_version": 1}},
    "xla2": {"backend": "xla_fsdp", "micro_batch_size": 2, "xla": {"fsdp_version": 2}},
    # one rank: loads the 2-rank checkpoints (2 -> 1), and XLA v1's (1 -> 1 across backends)
    "fsdp2_w1": {"backend": "fsdp", "micro_batch_size": 4},
}
SOURCES = ["fsdp2", "fsdp1", "zero1", "zero2", "zero3", "xla1", "xla2"]
# (names, how to launch): torch backends under torchrun, XLA on the single-process CPU client
LAUNCHES = [
    (["fsdp2", "fsdp1", "zero1", "zero2", "zero3"], {"nproc": 2}),
    (["xla1"], {"xla_devices": 1}),
    (["xla2"], {"xla_devices": 2}),
    (["fsdp2_w1"], {"nproc": 1}),
]
# SGD's state is one momentum buffer per parameter, moved by the same code as Adam's moments: a
# cycle covers it (each target loads the next source's), AdamW covers every pair
SGD_SOURCE = {target: SOURCES[(i + 1) % len(SOURCES)] for i, target in enumerate(BACKENDS)}
PLAN = {target: [f"{s}-adamw" for s in SOURCES] + [f"{SGD_SOURCE[target]}-sgd"]
        for target in BACKENDS}


def launch(tmp, phase, names, how):
    out = tmp / f"{phase}-{names[0]}.json"
    args = [str(WORKER), "--phase", phase, "--backends", str(tmp / "backends.json"),
            "--names", ",".join(names), "--root", str(tmp / "ckpt"), "--out", str(out),
            "--plan", str(tmp / "plan.json")]
    if "nproc" in how:
        torchrun(how["nproc"], args, timeout=400)
    else:
        env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(how["xla_devices"]),
               "USE_TORCH_XLA": "1"}
        torchrun(1, args, timeout=400, env=env)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("transfer")
    (tmp_path / "backends.json").write_text(json.dumps(BACKENDS))
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    (tmp_path / "ckpt").mkdir()
    saved, loaded = {}, {}
    for names, how in LAUNCHES:
        if set(names) & set(SOURCES):
            saved.update(launch(tmp_path, "save", names, how))
    for names, how in LAUNCHES:
        loaded.update(launch(tmp_path, "load", names, how))
    return tmp_path, saved, loaded


@needs_both
@pytest.mark.timeout(1200)
def test_every_pair_resumes_with_the_uninterrupted_losses(matrix):
    _, saved, loaded = matrix
    errors = {k: v["error"] for k, v in {**saved, **loaded}.items() if "error" in v}
    assert not errors, "\n\n".join(f"{k}:\n{v[-3000:]}" for k, v in errors.items())

    worst, pairs = 0.0, 0
    for opt in ("sgd", "adamw"):
        ref = saved[f"reference-{opt}"]["loss"]
        for source in SOURCES:
            before = saved[f"{source}-{opt}"]["loss"]
            assert max(abs(a - b) for a, b in zip(before, ref[:3])) <= 1e-5, (source, opt, before)
            for target in BACKENDS if opt == "adamw" else [t for t in BACKENDS
                                                           if SGD_SOURCE[t] == source]:
                res = loaded[f"{source}->{target}-{opt}"]
                assert res["start"] == 3, (source, target, res)
                diff = max(abs(a - b) for a, b in zip(res["loss"], ref[3:]))
                assert diff <= 1e-5, f"{source} -> {target} ({opt}): {res['loss']} vs {ref[3:]}"
                worst, pairs = max(worst, diff), pairs + 1
    assert pairs == len(SOURCES) * len(BACKENDS) + len(BACKENDS)
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

    tmp, saved, _ = matrix
    out = subprocess.run([sys.executable, "-m", "parallel.cli", "ckpt", "export", "--to", "hf",
                          str(tmp / "ckpt" / f"{source}-adamw"), str(tmp / f"hf-{source}")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp / f"hf-{source}", torch_dtype=torch.float32)
    ids = global_batches(5, 1, 4)[3]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert abs(loss - saved["reference-adamw"]["loss"][3]) <= 1e-5
