"""Tensor parallelism with FSDP2 (#31, the layer under `topology.tp`, which validation still
refuses): the model's own HF tp plan split over mesh["tp"], FSDP2 over mesh["dp_shard"], the same
losses and clipped gradient norms as one process on the global batch, at tp 2 and dp 2 x tp 2."""

import json

import pytest
from harness import ROOT, torchrun

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_with_tp_matches_one_process(tmp_path, world):
    out = tmp_path / "tp.json"
    torchrun(world, [str(ROOT / "tests" / "distributed" / "tp_worker.py"), "--tp", "2", "--out", str(out)], timeout=500)
    got = json.loads(out.read_text())
    for step in got["steps"]:
        assert abs(step["loss"] - step["ref_loss"]) < 1e-5, got["steps"]
        assert abs(step["norm"] - step["ref_norm"]) < 1e-4 * step["ref_norm"], got["steps"]
    assert got["plan"]["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert got["plan"]["lm_head"] == "colwise_rep"
    # q_proj split by rows over tp, then its tp shard sharded again by FSDP2 over dp
    assert got["q_full"] == [32, 32] and got["q_local"] == [32 // world, 32]
    # placements (dp_shard, tp): FSDP2's strided shard of the TP shard ("_S(0, 2)"), TP's Shard(0)
    assert got["q_placements"] == ["_S(0, 2)", "S(0)"], got["q_placements"]
