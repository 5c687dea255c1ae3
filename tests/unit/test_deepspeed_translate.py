"""The DeepSpeed translation of every neutral field, pinned; native merging; explain -> initialize."""

import json

import pytest

from backends.deepspeed.translate import translate
from parallel import SpecError, load_spec


def ds(**data):
    return translate(load_spec({"backend": "deepspeed", **data}))["config"]


@pytest.mark.parametrize("shard, stage", [("none", 0), ("optimizer", 1), ("grad_op", 2),
                                          ("full", 3), ("hybrid", 3)])
def test_shard_to_stage(shard, stage):
    topo = {"procs_per_node": 4, "shard_group_size": 2} if shard == "hybrid" else {}
    assert ds(shard=shard, topology=topo)["zero_optimization"]["stage"] == stage


def test_hybrid_is_zeropp_hpz_with_the_shard_group():
    zero = ds(shard="hybrid", topology={"nodes": 2, "procs_per_node": 8})["zero_optimization"]
    assert zero["zero_hpz_partition_size"] == 8


def test_clipping_is_always_explicit():
    assert ds()["gradient_clipping"] == 0.0  # DeepSpeed 0.19.8 would otherwise clip at 1.0
    assert ds(grad_clip=0.3)["gradient_clipping"] == 0.3


def test_batch_sizes():
    cfg = ds(micro_batch_size=4, grad_accum_steps=3, topology={"procs_per_node": 2})
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"],
            cfg["train_batch_size"]) == (4, 3, 24)


def test_precision():
    assert ds()["bf16"] == {"enabled": False} and ds()["fp16"] == {"enabled": False}
    bf16 = ds(precision="bf16")
    assert bf16["bf16"]["enabled"] and bf16["communication_data_type"] == "fp32"
    fp16 = ds(precision="fp16", loss_scale={"initial_scale_power": 12, "hysteresis": 3})["fp16"]
    assert fp16 == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                    "loss_scale_window": 1000, "hysteresis": 3, "min_loss_scale": 1.0}


def test_offload_and_client_optimizer_flags():
    zero = ds(shard="full", offload="params")
    assert zero["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert zero["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert zero["zero_force_ds_cpu_optimizer"] is False and zero["zero_allow_untested_optimizer"]
    assert "offload_param" not in ds(shard="grad_op", offload="optimizer")["zero_optimization"]
    with pytest.raises(SpecError, match="ZeRO-3 partitions only"):
        ds(shard="grad_op", offload="params")
    with pytest.raises(SpecError, match="needs ZeRO"):
        ds(shard="none", offload="optimizer")


def test_zero3_knobs():
    zero = ds(shard="full", deepspeed={"prefetch_bucket_size": 1000, "param_persistence_threshold":
                                       0, "gather_16bit_weights_on_model_save": False})
    z = zero["zero_optimization"]
    assert z["stage3_prefetch_bucket_size"] == 1000 and z["stage3_param_persistence_threshold"] == 0
    assert z["stage3_gather_16bit_weights_on_model_save"] is False


def test_native_merges_last_auto_fills_and_conflicts_name_both_values(tmp_path):
    cfg = ds(deepspeed={"native": {"zero_optimization": {"overlap_comm": True, "stage": "auto"},
                                   "gradient_clipping": "auto", "wall_clock_breakdown": True}})
    assert cfg["zero_optimization"] == {"stage": 3, "overlap_comm": True,
                                        "stage3_gather_16bit_weights_on_model_save": True}
    assert cfg["gradient_clipping"] == 0.0 and cfg["wall_clock_breakdown"] is True
    with pytest.raises(SpecError) as info:
        ds(shard="grad_op", grad_clip=1.0, deepspeed={"native": {
            "zero_optimization": {"stage": 3}, "gradient_clipping": 0.5}})
    found = dict(info.value.problems)
    assert "3 contradicts shard, which sets 2" in found["deepspeed.native.zero_optimization.stage"]
    assert "0.5 contradicts grad_clip" in found["deepspeed.native.gradient_clipping"]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}}))
    with pytest.raises(SpecError, match="deepspeed.native.bf16.enabled"):
        ds(deepspeed={"native": str(path)})
    with pytest.raises(SpecError, match="not a readable DeepSpeed config"):
        ds(deepspeed={"native": str(tmp_path / "missing.json")})


def test_autotp_through_native_is_refused_until_wired():
    """DeepSpeed AutoTP feeds every rank of a TP group one batch and sizes train_batch_size over
    world / tp; polyshard's loader would give each rank its own slice, another objective, so an
    imported or written `tensor_parallel.autotp_size` > 1 is refused naming the field."""
    from parallel.spec.io import SpecError, load_spec

    base = {"backend": "deepspeed", "topology": {"procs_per_node": 4}}
    with pytest.raises(SpecError) as err:
        load_spec({**base, "deepspeed": {"native": {"tensor_parallel": {"autotp_size": 2}}}})
    assert "deepspeed.native.tensor_parallel" in dict(err.value.problems)
    load_spec({**base, "deepspeed": {"native": {"tensor_parallel": {"autotp_size": 1}}}})
