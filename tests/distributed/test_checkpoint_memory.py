"""A rank's extra host memory while saving and loading is a small fraction of the model + optimizer
state (issues #16, #27): ZeRO-1/2/3 write and read, in place, only the ranges of each parameter their
partition holds (backends/deepspeed/checkpoint/fragments.py), and FSDP1 those of its flat shards
(backends/fsdp/flat_state.py), handed to DCP as tensors it writes without a copy
(parallel/checkpoint/state/chunks.py exact_view). Measured by sampling each rank's resident anonymous
memory every millisecond around `save` and `load` of a ~24M-parameter Llama with AdamW (model +
optimizer state: 12 bytes per parameter, 282 MB). `save_pretrained` (#44, hf_gather.py) holds two
segments of its pieces, not its files: bounded in bytes, whatever the model."""

import json

import pytest
from harness import ROOT, needs_both, torchrun
from matrix import FULL
from ckpt_memory_worker import SEGMENT_BYTES
from reliability import record

pytestmark = pytest.mark.distributed
BUDGET_S = 60  # seconds in make test (tests/conftest.py)

WORKER = ROOT / "tests" / "distributed" / "ckpt_memory_worker.py"
# make test: ZeRO-3 and FSDP1; make test-full (matrix.FULL) ZeRO-1/2 too (flat partitions, one save
# and load path for both, and gloo's gather on load below)
CELLS = {"zero1": {"backend": "deepspeed", "shard": "optimizer"},
         "zero2": {"backend": "deepspeed", "shard": "grad_op"},
         "zero3": {"backend": "deepspeed", "shard": "full"},
         "fsdp1": {"backend": "fsdp", "fsdp": {"version": 1}, "shard": "full"}}
if not FULL:
    CELLS = {k: CELLS[k] for k in ("zero3", "fsdp1")}
BOUND = 0.15  # of the whole model + optimizer state; gathering whole tensors needs >= 1
# ZeRO-1/2 load ends with DeepSpeed's all-gather of the fp32 masters into the (replicated) model
# weights, the one every optimizer step runs: gloo's all_gather_into_tensor allocates a temporary the
# size of its output (measured: 200 MB extra for a 200 MB output; NCCL gathers in place), here the
# fp32 model, 4 of the 12 bytes per parameter
GLOO_GATHER = 4 / 12
# save_pretrained (hf_gather): each rank writes its pieces in place, two segments held (one
# written, one cast or copied to the host), whatever the model, and freed segments the allocator
# keeps. Its predecessor, which sent every file's pieces to its writer in 4 MiB slices, measured
# 15-49 MB over ZeRO-1/2/3 at 2 and 4 ranks; holding a rank's file and its pieces whole, 94 MB at
# 2 ranks and 59 MB at 4 (1.0 and 0.63 of the fp32 weights): above this bound
HF_BOUND = 8 * SEGMENT_BYTES + 20e6  # 28.4 MB


def measure(tmp, world: int) -> dict:
    """Every cell at `world` ranks in one launch, one engine after another."""
    specs = {name: {**cell, "micro_batch_size": 1, "topology": {"procs_per_node": world}}
             for name, cell in CELLS.items()}
    out = tmp / f"memory-{world}.json"
    torchrun(world, [str(WORKER), "--specs", json.dumps(specs), "--dir", str(tmp / f"w{world}"),
                     "--out", str(out)], timeout=900)
    return json.loads(out.read_text())


@needs_both
@pytest.mark.timeout(1500)
def test_zero_and_fsdp1_checkpoints_hold_a_fraction_of_the_state_that_falls_with_n(tmp_path):
    rows, fractions, hf = [], {}, {}
    worlds = (2, 4) if FULL else (2,)  # make test-full: at 4 ranks too (a rank's share halves)
    measured = {world: measure(tmp_path, world) for world in worlds}
    for name in CELLS:
        for world in worlds:
            got = measured[world][name]
            whole = 12 * got["params"]
            worst = {k: max(r[k] for r in got["ranks"]) / whole for k in ("save", "load")}
            fractions[name, world] = worst
            step = max(r["step"] for r in got["ranks"]) / whole
            hf[name, world] = max(r["hf"] for r in got["ranks"])
            rows.append({"backend": name, "ranks": world, "whole model + AdamW MB": round(whole / 1e6),
                         "save: peak extra per rank": f"{worst['save']:.3f}",
                         "load: peak extra per rank": f"{worst['load']:.3f}",
                         "a training step's own peak": f"{step:.2f}",
                         "save_pretrained: peak extra MB": f"{hf[name, world] / 1e6:.1f}"})
    record("checkpoint-memory", {"summary": "peak extra host memory of the worst rank during save "
                                 "and load, as a fraction of the whole model + optimizer state",
                                 "rows": rows})
    for (name, world), worst in fractions.items():
        assert worst["save"] <= BOUND, (name, world, worst)
        gathered = GLOO_GATHER if name in ("zero1", "zero2") else 0.0
        assert worst["load"] <= BOUND + gathered, (name, world, worst)
        assert hf[name, world] <= HF_BOUND, (name, world, hf[name, world])
