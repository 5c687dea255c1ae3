"""torch FSDP's set-up steps (backends/fsdp/parallelize.py), each alone on a meta-device model as rank 1
of a world of 4 over torch's fake process group: nothing is allocated, nothing communicates, and what
each step did to the model is read back from it."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from backends.fsdp.parallelize import (
    apply_forward_prefetch,
    apply_fsdp2,
    apply_tp,
    fsdp2_kwargs,
    fsdp1_kwargs,
)
from parallel.engine.model.tp_plan import resolve_plan
from parallel.engine.model.wrap import apply_ac, at_unit_places, plan_wrap
from parallel.spec.errors import SpecError
from parallel.spec.sections import Wrap
from parallel.toy import build_llama, llama_config


@pytest.fixture
def world():
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers backend "fake")

    dist.init_process_group("fake", store=dist.HashStore(), rank=1, world_size=4)
    yield 4
    dist.destroy_process_group()


def meta_llama():
    with torch.device("meta"):
        return build_llama(llama_config("tiny"))


def test_apply_fsdp2_shards_units_edges_and_root(world):
    model = meta_llama()
    units = plan_wrap(model, Wrap())
    mesh = init_device_mesh("cpu", (world,))
    kwargs = fsdp2_kwargs({"reshard_after_forward": True}, "cpu")
    apply_fsdp2(model, units, mesh, kwargs, reshard_output=False)
    from torch.distributed.fsdp import FSDPModule

    sharded = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    # every decoder layer, the embedding on its own, and the root (norm + head joined the root's
    # group as one unit: fully_shard on a list marks its first module's state)
    assert [n for n, _ in units] and all(n in sharded for n, _ in units)
    assert "model.embed_tokens" in sharded and "" in sharded
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(weight, DTensor) and weight.to_local().shape[0] == weight.shape[0] // world
    # the output unit stays gathered after forward, the blocks reshard (torchtitan's layout)
    state = model.model.layers[0]._get_fsdp_state()
    assert state._fsdp_param_group.post_forward_mesh_info is not None
    head_group = model.model.norm._get_fsdp_state()._fsdp_param_group
    assert head_group.post_forward_mesh_info is None


def test_apply_tp_splits_by_the_plan_before_fully_shard(world):
    model = meta_llama()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = resolve_plan(model, 2, None, lambda message: None)
    apply_tp(model, mesh["tp"], plan)
    q, o = model.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.o_proj.weight
    assert isinstance(q, DTensor) and q.to_local().shape == (q.shape[0] // 2, q.shape[1])  # colwise
    assert o.to_local().shape == (o.shape[0], o.shape[1] // 2)  # rowwise
    assert not isinstance(model.model.embed_tokens.weight, DTensor)  # not in the plan: whole


def test_apply_ac_then_units_at_their_places(world):
    model = meta_llama()
    units = plan_wrap(model, Wrap())
    apply_ac(model, units)
    placed = at_unit_places(model, units)
    assert all(type(m).__name__ == "CheckpointWrapper" for _, m in placed)
    assert not model.config.use_cache  # recomputation would append the cache twice


def test_forward_prefetch_follows_forward_order(world):
    model = meta_llama()
    units = plan_wrap(model, Wrap())
    apply_fsdp2(model, units, init_device_mesh("cpu", (world,)),
                fsdp2_kwargs({"reshard_after_forward": True}, "cpu"), reshard_output=False)
    apply_forward_prefetch(model, units)
    layers = list(model.model.layers)
    nxt = layers[0]._get_fsdp_state()._states_to_forward_prefetch
    assert [s._modules[0] for s in nxt] == [layers[1]]


def test_kwargs_become_torch_objects_and_unknown_native_keys_are_refused():
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, ShardingStrategy

    two = fsdp2_kwargs({"reshard_after_forward": True,
                        "mp_policy": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}, "cpu")
    assert two["mp_policy"] == MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
    with pytest.raises(SpecError, match="fsdp.native.no_such_key"):
        fsdp2_kwargs({"reshard_after_forward": True, "no_such_key": 1}, "cpu")
    one = fsdp1_kwargs({"sharding_strategy": "SHARD_GRAD_OP", "backward_prefetch": None,
                        "cpu_offload": True, "mixed_precision": {"param_dtype": "fp16",
                                                                 "reduce_dtype": None}},
                       torch.device("cpu"), None)
    assert one["sharding_strategy"] is ShardingStrategy.SHARD_GRAD_OP
    assert not one["cpu_offload"].offload_params  # on a CPU device the parameters already are
    assert one["mixed_precision"] == MixedPrecision(param_dtype=torch.float16,
                                                    reduce_dtype=torch.float32)
