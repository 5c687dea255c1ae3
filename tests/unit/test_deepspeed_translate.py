"""The DeepSpeed translation of every neutral field, pinned; native merging; explain -> initialize."""

import json

import pytest

from backends.deepspeed.config.translate import MODEL_SIZED, translate
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
                                        "stage3_gather_16bit_weights_on_model_save": True,
                                        **{k.split(".")[1]: v for k, v in MODEL_SIZED.items()}}
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


def test_topology_tp_is_autotp_and_native_keys_cannot_pick_another_split():
    """topology.tp is AutoTP's size, with polyshard's plan as its partition_config and DeepSpeed
    left to derive train_batch_size (it checks it against different worlds in one job: docs/tp.md);
    written under deepspeed.native, AutoTP's size must be topology.tp and its split the plan's."""
    from parallel.spec.io import SpecError, load_spec

    base = {"backend": "deepspeed", "shard": "grad_op", "topology": {"procs_per_node": 4}}
    tp = {**base, "topology": {"procs_per_node": 4, "tp": 2}}
    config = translate(load_spec(tp))["config"]
    assert config["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}
    assert "train_batch_size" not in config
    planned = {**tp, "topology": {**tp["topology"], "tp_plan": {"lm_head": "colwise_rep"}}}
    spec = translate(load_spec(planned))["config"]["tensor_parallel"]["partition_config"]
    assert spec["layer_specs"] == [{"patterns": [r"(?s:lm_head)\.weight\Z"],
                                    "partition_type": "column", "gather_output": True}]
    with pytest.raises(SpecError) as err:  # AutoTP without topology.tp: one batch per TP group
        load_spec({**base, "deepspeed": {"native": {"tensor_parallel": {"autotp_size": 2}}}})
    assert "topology.tp: 2" in dict(err.value.problems)["deepspeed.native.tensor_parallel"]
    load_spec({**base, "deepspeed": {"native": {"tensor_parallel": {"autotp_size": 1}}}})
    for key, value in (("partition_config", {"layer_specs": []}), ("preset_model", "llama"),
                       ("vocab_parallel_lm_head", True)):
        with pytest.raises(SpecError) as err:
            load_spec({**tp, "deepspeed": {"native": {"tensor_parallel": {key: value}}}})
        assert f"deepspeed.native.tensor_parallel.{key}" in dict(err.value.problems), key
    with pytest.raises(SpecError, match="deepspeed.native.tensor_parallel.autotp_size"):
        load_spec({**tp, "deepspeed": {"native": {"tensor_parallel": {"autotp_size": 4}}}})
    with pytest.raises(SpecError, match="deepspeed.native.train_batch_size"):
        load_spec({**tp, "deepspeed": {"native": {"train_batch_size": 8}}})
    kept = load_spec({**tp, "deepspeed": {"native": {"tensor_parallel": {"tp_overlap_comm": True}}}})
    assert translate(kept)["config"]["tensor_parallel"]["tp_overlap_comm"] is True

def test_the_reduce_bucket_is_no_larger_than_the_model_unless_the_spec_sizes_it():
    """DeepSpeed's 5e8-element reduce bucket is allocated whole whatever the model (1907 MiB per
    rank in fp32 for a 3 M-parameter model): unset, it is min(5e8, trainable parameters)."""
    from types import SimpleNamespace

    import torch

    from backends.deepspeed.plan import transient
    from backends.deepspeed.config.translate import fill_model_autos

    spec = load_spec({"backend": "deepspeed", "shard": "full"})
    config = translate(spec)["config"]
    sized = "min(5e8, trainable parameters) (at prepare)"
    assert config["zero_optimization"]["reduce_bucket_size"] == sized
    assert "stage3_prefetch_bucket_size" not in config["zero_optimization"]  # DeepSpeed's own
    model = torch.nn.Linear(100, 30)  # 3,030 parameters, 30 of them frozen below
    model.bias.requires_grad_(False)
    assert fill_model_autos(config, model)["zero_optimization"]["reduce_bucket_size"] == 3000
    big = SimpleNamespace(parameters=lambda: [SimpleNamespace(ds_numel=8 * 10**9,
                                                              requires_grad=True)])
    assert fill_model_autos(config, big)["zero_optimization"]["reduce_bucket_size"] == 5 * 10**8
    # the plan counts the bucket the run allocates
    assert transient(spec, 3e6, 1e5, 4)[1] == 3e6 * 4
    assert transient(spec, 8e9, 1e9, 4)[1] == 5e8 * 4
    kept = load_spec({"backend": "deepspeed", "shard": "grad_op",
                      "deepspeed": {"reduce_bucket_size": 1_000_000}})
    assert translate(kept)["config"]["zero_optimization"]["reduce_bucket_size"] == 1_000_000
    zero0 = translate(load_spec({"backend": "deepspeed", "shard": "none"}))["config"]
    assert "reduce_bucket_size" not in zero0["zero_optimization"]  # ZeRO-0 has no bucket
