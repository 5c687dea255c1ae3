"""The FSDP translation of every neutral field, pinned; and the wrap plan."""

import pytest
from torch import nn

from backends.fsdp.translate import mesh_shape, translate
from parallel import SpecError, load_spec
from parallel.spec.sections import Wrap
from parallel.engine.model.wrap import plan_wrap


def fsdp(version=2, **data):
    return translate(load_spec({"fsdp": {"version": version, **data.pop("fsdp", {})}, **data}))


@pytest.mark.parametrize("shard, reshard", [("full", True), ("grad_op", False), ("none", False),
                                            ("hybrid", True), ("hybrid_grad_op", False)])
def test_fsdp2_reshard_after_forward_follows_shard(shard, reshard):
    assert fsdp(shard=shard)["kwargs"]["reshard_after_forward"] is reshard


@pytest.mark.parametrize("shard, strategy", [("full", "FULL_SHARD"), ("grad_op", "SHARD_GRAD_OP"),
                                             ("none", "NO_SHARD"), ("hybrid", "HYBRID_SHARD"),
                                             ("hybrid_grad_op", "_HYBRID_SHARD_ZERO2")])
def test_fsdp1_sharding_strategy_names(shard, strategy):
    topo = {"procs_per_node": 4, "shard_group_size": 2} if "hybrid" in shard else {}
    assert fsdp(1, shard=shard, topology=topo)["kwargs"]["sharding_strategy"] == strategy


def test_meshes():
    assert mesh_shape(load_spec({"topology": {"procs_per_node": 4}})) == (4,)
    assert mesh_shape(load_spec({"shard": "none", "topology": {"procs_per_node": 4}})) == (4, 1)
    hybrid = load_spec({"shard": "hybrid", "topology": {"nodes": 2, "procs_per_node": 4}})
    assert mesh_shape(hybrid) == (2, 4)


def test_precision_and_offload():
    out = fsdp(precision="bf16", offload="params")["kwargs"]
    assert out["mp_policy"] == {"param_dtype": "bf16", "reduce_dtype": "fp32"}
    assert out["offload_policy"] == {"pin_memory": True}
    assert "mp_policy" not in fsdp()["kwargs"]
    v1 = fsdp(1, precision="fp16", offload="params", fsdp={"backward_prefetch": "backward_post",
                                                            "forward_prefetch": True})["kwargs"]
    assert v1["mixed_precision"]["param_dtype"] == "fp16" and v1["cpu_offload"] is True
    assert v1["backward_prefetch"] == "BACKWARD_POST" and v1["forward_prefetch"] is True


def test_native_merges_last_and_conflicts_name_both_values():
    with pytest.raises(SpecError) as info:
        fsdp(shard="full", fsdp={"native": {"reshard_after_forward": False}})
    (path, message), = info.value.problems
    assert path == "fsdp.native.reshard_after_forward"
    assert "False" in message and "shard" in message and "True" in message
    assert fsdp(shard="grad_op", fsdp={"native": {"reshard_after_forward": False}})
    with pytest.raises(SpecError, match="fsdp.sync_module_states"):
        fsdp(1, fsdp={"native": {"sync_module_states": False}})
    extra = fsdp(1, fsdp={"native": {"ignored_states": None}})["kwargs"]
    assert extra["ignored_states"] is None  # new keys pass through


def test_fsdp1_hybrid_with_one_rank_shard_groups_is_an_error():
    with pytest.raises(SpecError, match="silently trains each replica alone"):
        fsdp(1, shard="hybrid", topology={"procs_per_node": 2, "shard_group_size": 1})
    assert fsdp(2, shard="hybrid", topology={"procs_per_node": 2, "shard_group_size": 1})


def test_torch_only_loss_scale_knobs():
    with pytest.raises(SpecError, match="loss_scale.hysteresis"):
        fsdp(precision="fp16", loss_scale={"hysteresis": 4})


class Block(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([Block(8), Block(8)])
        self.head = nn.Linear(8, 100)


def test_wrap_plans():
    net = Net()
    auto = [n for n, _ in plan_wrap(net, Wrap())]
    assert auto == ["blocks.1", "blocks.0"]  # children first
    by_class = plan_wrap(net, Wrap(policy="layer_classes", layer_classes=["Block"]))
    assert [n for n, _ in by_class] == auto
    # Size, bottom-up as torch's rule: each Linear(8, 8) holds 72 params and is wrapped first,
    # the embedding (80) and head (900) too; the ModuleList container is never a unit.
    assert [n for n, _ in plan_wrap(net, Wrap(policy="size", min_num_params=70))] == [
        "embed", "blocks.0.lin", "blocks.1.lin", "head"]
    assert [n for n, _ in plan_wrap(net, Wrap(policy="size", min_num_params=100))] == ["head"]
    assert plan_wrap(net, Wrap(policy="none")) == []
    with pytest.raises(SpecError, match="not found in Net; candidates"):
        plan_wrap(net, Wrap(policy="layer_classes", layer_classes=["Nope"]))
    with pytest.raises(SpecError, match="does not define"):
        plan_wrap(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), Wrap())
