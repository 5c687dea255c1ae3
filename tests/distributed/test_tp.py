"""Tensor parallelism (`topology.tp`) through the engine, against one process on the global batch.

Cases come from the registry: every backend whose descriptor says `tensor_parallel` (today FSDP2)
runs dp 2 x tp 2 on 4 gloo ranks, with padded SFT rows, accumulation, clipping, activation
checkpointing, HSDP's 3-D mesh and rank-0-only loading, saving after step 3 and resuming in fresh
processes; then a tp 2 checkpoint moves to tp 1, to another world size and to the other backends."""

import json

import matrix
import pytest
from harness import ROOT, case, check_parity, needs_both, run_parity, torchrun

from parallel import registry

pytestmark = pytest.mark.distributed

TP_BACKENDS = [d.name for d in registry.descriptors() if d.tensor_parallel]


def tp_spec(backend, world=4, tp=2, **extra):
    return {"backend": backend, "topology": {"procs_per_node": world, "tp": tp},
            "micro_batch_size": 2, "wrap": {"policy": "auto"}, **extra}


def cases(backend):
    base = tp_spec(backend)
    return [
        case("dp2-tp2", base, optimizer="adamw"),
        case("padded-accum-clip-ac", {**base, "micro_batch_size": 1, "grad_accum_steps": 2,
                                      "grad_clip": 0.5, "activation_checkpointing": True},
             optimizer="adamw", padded=True),
        case("hsdp-3d", {**base, "shard": "hybrid", "topology": {"procs_per_node": 4, "tp": 2,
                                                                 "shard_group_size": 1}}),
        *([case("rank0-loading", {**base, "fsdp": {"cpu_ram_efficient_loading": True}},
                optimizer="adamw", factory=True)] if backend == "fsdp" else []),
    ]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", TP_BACKENDS)
def test_tp_matches_one_process_and_resumes(tmp_path, backend):
    results = run_parity(tmp_path, cases(backend), nproc=4, timeout=300)
    worst = {name: check_parity(name, res) for name, res in results.items()}
    for name, res in results.items():  # the checkpoint read whole in one process: full shapes
        assert abs(res["train"]["consolidated_loss"] - res["train"]["loss"][3]) <= 1e-5, name
    print(f"{backend} tp: max |loss - one process| per case: {worst}")


TRANSFER = ROOT / "tests" / "distributed" / "transfer_worker.py"
TARGETS = ("fsdp2", "zero2", "xla2")  # data-parallel variants that load the tp checkpoint


@needs_both
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", TP_BACKENDS)
def test_tp_checkpoint_loads_at_tp1_other_worlds_and_backends(tmp_path, backend):
    """Saved at tp 2 on 2 ranks (dp 1, micro-batch 4): loaded at dp 2 x tp 2 on 4 ranks, at tp 1 on
    FSDP2, ZeRO-2 and XLA SPMD, with AdamW's moments and step counts: the uninterrupted losses."""
    chosen = [c for c in matrix.cases(world=2, micro_batch_size=2) if c.name in TARGETS]
    specs = {c.name: c.spec for c in chosen}
    specs["tp2"] = tp_spec(backend, world=2, micro_batch_size=4)
    specs["dp2-tp2"] = tp_spec(backend, world=4)
    (tmp_path / "backends.json").write_text(json.dumps(specs))
    (tmp_path / "ckpt").mkdir()
    plan = {name: ["tp2-adamw"] for name in specs}
    (tmp_path / "plan.json").write_text(json.dumps(plan))

    def launch(phase, names, nproc, env=None):
        out = tmp_path / f"{phase}-{names[0]}.json"
        torchrun(nproc, [str(TRANSFER), "--phase", phase, "--backends", str(tmp_path / "backends.json"),
                         "--names", ",".join(names), "--root", str(tmp_path / "ckpt"), "--out",
                         str(out), "--plan", str(tmp_path / "plan.json"), "--optimizers", "adamw"],
                 timeout=300, env=env)
        return json.loads(out.read_text())

    saved = launch("save", ["tp2"], 2)
    loaded = {}
    loaded.update(launch("load", ["tp2"], 2))
    loaded.update(launch("load", ["dp2-tp2"], 4))
    for group in matrix.by_launch(chosen):
        loaded.update(launch("load", [c.name for c in group], group[0].nproc, group[0].env))
    errors = {k: v["error"] for k, v in {**saved, **loaded}.items() if "error" in v}
    assert not errors, "\n\n".join(f"{k}:\n{v[-3000:]}" for k, v in errors.items())
    ref = saved["reference-adamw"]["loss"]
    assert max(abs(a - b) for a, b in zip(saved["tp2-adamw"]["loss"], ref[:3])) <= 1e-5
    for target in specs:
        res = loaded[f"tp2->{target}-adamw"]
        assert res["start"] == 3, (target, res)
        diff = max(abs(a - b) for a, b in zip(res["loss"], ref[3:]))
        assert diff <= 1e-5, f"tp2 -> {target}: {res['loss']} vs {ref[3:]}"
