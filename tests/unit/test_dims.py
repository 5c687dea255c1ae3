"""ParallelDims owns every dimension: data-parallel facts (size, rank, the batch rule, DeepSpeed's
train_batch_size, FSDP's mesh) come from it, never from the world size, so tp > 1 changes them."""

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from parallel.spec.dims import ParallelDims
from parallel.spec.io import load_spec

ROOT = Path(__file__).resolve().parents[2]


def fake(world, tp=1, shard="full", group=None, per_node=None):
    topo = SimpleNamespace(tp=tp, shard_group_size=group, procs_per_node=per_node or world)
    return SimpleNamespace(world_size=world, shard=shard, topology=topo)


@pytest.mark.parametrize("world,tp,shard,group,want", [
    (8, 1, "full", None, (1, 8, 1)), (8, 2, "full", None, (1, 4, 2)),
    (8, 2, "none", None, (4, 1, 2)), (16, 2, "hybrid", 4, (2, 4, 2)),
    (1024, 8, "hybrid", 8, (16, 8, 8)),
])
def test_layout(world, tp, shard, group, want):
    dims = ParallelDims.from_spec(fake(world, tp, shard, group))
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == want
    assert dims.world_size == world and dims.dp_size == world // tp
    # tp fastest, as the mesh is laid out: a tp group is consecutive ranks sharing one batch slice
    assert [dims.dp_rank(r) for r in range(2 * tp)] == [0] * tp + [1] * tp


def test_spec_data_parallel_facts_come_from_dims():
    spec = load_spec({"backend": "deepspeed", "micro_batch_size": 2, "grad_accum_steps": 3,
                      "topology": {"procs_per_node": 4}})
    assert spec.dims.dp_size == spec.shard_group_size == 4
    from backends.deepspeed.translate import translate

    assert translate(spec)["config"]["train_batch_size"] == 2 * 3 * 4


def test_no_batch_arithmetic_multiplies_by_the_world_size():
    """A product of the batch and the world size means the data-parallel size (tp ranks share a
    batch): it must ask spec.dims / engine.dp_size."""
    bad = []
    for path in [*ROOT.glob("parallel/**/*.py"), *ROOT.glob("backends/**/*.py")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(grad_accum_steps|samples_per_step|rows)\s*\*.*world_size", line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_mesh_names_every_dimension():
    """One gloo rank: the engine's mesh is (dp_replicate, dp_shard, tp), size-1 dims included."""
    code = ("import os, torch.distributed as dist\n"
            "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29591')\n"
            "dist.init_process_group('gloo', rank=0, world_size=1)\n"
            "from parallel.spec.dims import ParallelDims\n"
            "m = ParallelDims(1, 1, 1).device_mesh('cpu')\n"
            "print(m.mesh_dim_names, m['dp_replicate', 'dp_shard'].ndim, m['tp'].size())\n"
            "dist.destroy_process_group()\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1].split() == ["('dp_replicate',", "'dp_shard',", "'tp')", "2", "1"]
