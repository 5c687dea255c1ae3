"""accelerate / DeepSpeed / HF Trainer interop, one test per class of defect issue #13 found (the
whole real-file corpus runs through the tools' own parsers in test_real_configs.py)."""

import functools
import json

import os
from unittest import mock
import torch
import pytest
import yaml

from backends.deepspeed.files import interop as ds_interop
from accelerate_host import gpu_host
from parallel.cli.main import main
from parallel.interop.accelerate import from_accelerate
from parallel.interop.export import export
from parallel.registry import explain
from parallel.spec.io import SpecError, load_spec

from_deepspeed = functools.partial(ds_interop.from_deepspeed, validate=load_spec)  # the CLI's validation

DATA = __import__("pathlib").Path(__file__).with_name("data")
FSDP = {"distributed_type": "FSDP", "num_processes": 2}


def export_to(fmt, spec):
    return export(spec, fmt)


def problems(fn, *args, **kwargs) -> dict[str, str]:
    with pytest.raises(SpecError) as err:
        fn(*args, **kwargs)
    return dict(err.value.problems)


def test_the_seed_accelerate_config_means_what_accelerate_makes_of_it():
    cfg = yaml.safe_load((DATA / "accelerate_fsdp_seed.yaml").read_text())
    data, report = from_accelerate(cfg)
    spec = load_spec(data)
    assert (spec.backend, spec.shard, spec.offload, spec.precision) == ("fsdp", "full", "params",
                                                                        "bf16")
    assert spec.wrap.layer_classes == ["BertLayer"] and spec.fsdp.version == 1
    # accelerate 1.11 reads fsdp_backward_prefetch, not this older name: no prefetch, and it says so
    assert spec.fsdp.backward_prefetch == "none"
    assert any(f == "fsdp_config.fsdp_backward_prefetch_policy" and o == "ignored"
               for f, o, _ in report)


def test_transformer_wrap_without_classes_is_auto_and_demo_export_imports_back(tmp_path, capsys):
    data, _ = from_accelerate({**FSDP, "fsdp_config": {
        "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}})
    assert data["wrap"] == {"policy": "auto"}
    out = tmp_path / "acc.yaml"
    assert main(["export", "--to", "accelerate", "configs/demo.yaml", "-o", str(out)]) == 0
    assert main(["import", "accelerate", str(out)]) == 0
    back = load_spec(yaml.safe_load(capsys.readouterr().out))
    demo = load_spec(yaml.safe_load(open("configs/demo.yaml")))
    for field in ("backend", "shard", "offload", "precision", "wrap", "topology", "state_dict"):
        assert getattr(back, field) == getattr(demo, field), field


def test_auto_precision_is_decided_by_the_spec_never_by_key_order():
    cfg = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
           "zero_optimization": {"stage": 2}}
    data, report = from_deepspeed(cfg)
    assert "precision" not in data  # the spec's (default fp32), reported as decided there
    assert any(o == "auto" and "precision" in d for _, o, d in report)
    data, _ = from_deepspeed(cfg, given={"precision": "bf16"})
    assert load_spec({**data, "precision": "bf16"}).precision == "bf16"
    assert problems(from_deepspeed, {"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_absent_fields_mean_deepspeeds_defaults():
    data, _ = from_deepspeed({"train_micro_batch_size_per_gpu": 2})
    spec = load_spec(data)
    assert spec.shard == "none"  # no zero_optimization: ZeRO-0
    assert spec.grad_clip == 1.0 and spec.reduce_dtype == "compute"  # DeepSpeed's, not polyshard's
    data, _ = from_deepspeed({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 1,
                              "gradient_accumulation_steps": 8, "zero_optimization": {"stage": 3}},
                             given={"topology": {"nodes": 4, "procs_per_node": 8}})
    assert data["global_batch_size"] == 256
    spec = load_spec({**data, "topology": {"nodes": 4, "procs_per_node": 8}})
    assert explain(spec)["config"]["train_batch_size"] == 256
    # the global batch is a constraint: another world size fails instead of changing it
    assert "global_batch_size" in problems(load_spec, {**data, "topology": {"procs_per_node": 8}})
    data, _ = from_deepspeed({"fp16": {"enabled": True, "loss_scale_window": 100,
                                       "initial_scale_power": 32}})
    assert load_spec(data).loss_scale.growth_interval == 100
    assert load_spec(data).loss_scale.initial_scale_power == 32


def test_offload_details_are_kept_pinning_and_nvme():
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    assert load_spec(from_deepspeed({"zero_optimization": zero})[0]).pin_memory is True  # default
    nvme = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
            "offload_param": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": False,
                              "buffer_count": 6}}
    nvme["offload_optimizer"]["pin_memory"] = False
    spec = load_spec(from_deepspeed({"zero_optimization": nvme})[0])
    zero_out = explain(spec)["config"]["zero_optimization"]
    assert zero_out["offload_param"] == {"device": "nvme", "pin_memory": False, "nvme_path": "/nvme",
                                         "buffer_count": 6}
    assert zero_out["offload_optimizer"]["device"] == "nvme"
    data, _ = from_deepspeed({"fp16": {"enabled": True, "auto_cast": True}})
    assert explain(load_spec(data))["config"]["fp16"]["auto_cast"] is True


@pytest.mark.parametrize("cfg,field", [
    ({"distributed_type": "MEGATRON_LM", "num_processes": 1}, "distributed_type"),
    ({"distributed_type": "XLA", "num_processes": 8}, "distributed_type"),
    ({}, "<file>"),
    ({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}, "<file>"),
    ({**FSDP, "mixed_precision": "fp8"}, "mixed_precision"),
    ({**FSDP, "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARDS"}},
     "fsdp_config.fsdp_sharding_strategy"),
    ({**FSDP, "fsdp_confg": {}}, "fsdp_confg"),
])
def test_what_cannot_be_kept_fails_naming_the_field(cfg, field):
    assert field in problems(from_accelerate, cfg)


def test_data_parallel_types_map_to_shard_none():
    for kind in ("MULTI_GPU", "MULTI_CPU"):
        spec = load_spec(from_accelerate({"distributed_type": kind, "num_processes": 4})[0])
        assert (spec.backend, spec.shard, spec.world_size) == ("fsdp", "none", 4)
    one = load_spec(from_accelerate({"distributed_type": "NO", "num_processes": 8})[0])
    assert one.world_size == 1  # NO launches one process whatever num_processes says


def test_deepspeed_refusals_match_deepspeeds_own():
    from backends.deepspeed.config.schema import zero_key_problems  # noqa: F401 - same tables as native

    found = problems(from_deepspeed, {"zero_optimisation": {"stage": 3}, "gradient_cliping": 1.0})
    assert "did you mean 'zero_optimization'" in found["zero_optimisation"]
    assert "did you mean 'gradient_clipping'" in found["gradient_cliping"]
    found = problems(from_deepspeed, {"zero_optimization": {"stage": 3, "overlap_com": True,
                                                            "offload_optimiser": {"device": "cpu"}}})
    assert set(found) == {"zero_optimization.overlap_com", "zero_optimization.offload_optimiser"}
    # the adapter's own passthrough: what DeepSpeed refuses is refused at validate
    axolotl_pair = {"backend": "deepspeed", "deepspeed": {"native": {"zero_optimization": {
        "gather_16bit_weights_on_model_save": True}}}}
    config = explain(load_spec(axolotl_pair))["config"]["zero_optimization"]
    assert "gather_16bit_weights_on_model_save" not in config  # one name: stage3_ ...
    assert config["stage3_gather_16bit_weights_on_model_save"] is True
    bad = {"backend": "deepspeed", "deepspeed": {"native": {"zero_optimization": {
        "stage3_gather_16bit_weights_on_model_save": True, "gather_16bit_weights_on_model_save": True}}}}
    # one validation layer: load_spec refuses it, as validate, explain and the engine would
    assert "under two names" in " ".join(problems(load_spec, bad).values())
    assert problems(load_spec, {"backend": "deepspeed", "deepspeed": {
        "native": {"optimizer": {"type": "AdamW"}}}})


def test_parallelism_config_is_hybrid_sharding_and_round_trips():
    cfg = {"distributed_type": "FSDP", "num_processes": 8, "num_machines": 2,
           "fsdp_config": {"fsdp_version": 2},
           "parallelism_config": {"parallelism_config_dp_replicate_size": 2,
                                  "parallelism_config_dp_shard_size": 4}}
    spec = load_spec(from_accelerate(cfg)[0])
    assert (spec.shard, spec.shard_group_size) == ("hybrid", 4)
    assert export_to("accelerate", spec)["parallelism_config"] == cfg["parallelism_config"]
    # cp_size is topology.cp (tests/unit/test_cp_interop.py round-trips it)
    cp = {**cfg, "parallelism_config": {"parallelism_config_cp_size": 2}}
    assert from_accelerate(cp)[0]["topology"]["cp"] == 2


def test_accelerate_tp_size_is_topology_tp_and_round_trips():
    """accelerate's tp_size over FSDP2 is topology.tp (its mesh puts tp innermost, as ours), back
    and forth; what accelerate cannot carry is refused naming the field."""
    par = {"parallelism_config_dp_shard_size": 4, "parallelism_config_tp_size": 2}
    cfg = {"distributed_type": "FSDP", "num_processes": 8, "fsdp_config": {"fsdp_version": 2},
           "parallelism_config": par}
    spec = load_spec(from_accelerate(cfg)[0])
    assert (spec.topology.tp, spec.dims.dp_shard, spec.shard) == (2, 4, "full")
    assert export_to("accelerate", spec)["parallelism_config"] == par
    hybrid = {**cfg, "num_processes": 16, "num_machines": 2, "parallelism_config": {
        "parallelism_config_dp_replicate_size": 2, **par}}
    spec = load_spec(from_accelerate(hybrid)[0])
    assert (spec.dims.dp_replicate, spec.dims.dp_shard, spec.dims.tp) == (2, 4, 2)
    assert export_to("accelerate", spec)["parallelism_config"] == hybrid["parallelism_config"]
    tp_spec = {"backend": "fsdp", "topology": {"procs_per_node": 4, "tp": 2}}
    assert "topology.tp" in problems(export_to, "hf-trainer", load_spec(tp_spec))
    own = load_spec({**tp_spec, "topology": {**tp_spec["topology"],
                                             "tp_plan": {"lm_head": "colwise_rep"}}})
    assert "topology.tp_plan" in problems(export_to, "accelerate", own)


def test_names_accelerate_uses_today():
    data, report = from_accelerate({**FSDP, "fsdp_config": {
        "fsdp_version": 2, "fsdp_reshard_after_forward": False, "fsdp_ignored_modules": None}})
    assert data["shard"] == "grad_op"
    data, report = from_accelerate({"distributed_type": "DEEPSPEED", "num_processes": 8,
                                    "deepspeed_config": {"zero_stage": 3,
                                                         "zero3_save_16bit_model": True,
                                                         "deepspeed_multinode_launcher": "standard"}})
    spec = load_spec(data)
    assert spec.deepspeed.gather_16bit_weights_on_model_save and spec.deepspeed.zero_init
    assert ("deepspeed_config.deepspeed_multinode_launcher", "launch") in [(f, o) for f, o, _ in report]


def test_optimizer_blocks_with_values_are_refused_all_auto_ones_left_to_the_script():
    auto = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    _, report = from_deepspeed(auto)
    assert ("optimizer", "auto") in [(f, o) for f, o, _ in report]
    valued = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-5}}}
    assert "torch.optim.AdamW" in problems(from_deepspeed, valued)["optimizer"]
    _, report = from_deepspeed(valued, lossy=True)
    assert ("optimizer", "lost") in [(f, o) for f, o, _ in report]


def test_cli_bad_input_exits_2_without_a_traceback(tmp_path, capsys):
    (tmp_path / "tabs.yaml").write_text("distributed_type: FSDP\nfsdp_config:\n\tfsdp_version: 2\n")
    assert main(["import", "accelerate", str(tmp_path / "tabs.yaml")]) == 2
    assert "never tabs" in capsys.readouterr().err
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 7}}')
    assert main(["import", "deepspeed", str(tmp_path / "ds.json")]) == 2
    assert "zero_optimization.stage: 7 is no ZeRO stage" in capsys.readouterr().err
    (tmp_path / "dup.json").write_text('{"gradient_clipping": 1, "gradient_clipping": 2}')
    assert main(["import", "deepspeed", str(tmp_path / "dup.json")]) == 2
    assert "duplicate keys" in capsys.readouterr().err
    (tmp_path / "hjson.json").write_text('{\n  // DeepSpeed reads comments\n  "zero_optimization": '
                                         '{"stage": 1}\n}')
    assert main(["import", "deepspeed", str(tmp_path / "hjson.json")]) == 0
    assert main(["import", "accelerate", str(tmp_path / "missing.yaml")]) == 2


def test_accelerate_export_keeps_what_it_used_to_drop(tmp_path):
    spec = load_spec({"backend": "fsdp", "shard": "grad_op", "precision": "bf16",
                      "topology": {"nodes": 2, "procs_per_node": 4, "rdzv_endpoint": "10.0.0.1:29400"}})
    out = export_to("accelerate", spec)
    assert out["main_process_ip"] == "10.0.0.1" and out["main_process_port"] == 29400
    fsdp = out["fsdp_config"]
    assert fsdp["fsdp_reshard_after_forward"] is False and "fsdp_sharding_strategy" not in fsdp
    ds = export_to("accelerate", load_spec({"backend": "deepspeed", "shard": "full", "precision": "bf16"}))
    files = ds.pop("__files__")
    assert ds["deepspeed_config"]["deepspeed_config_file"] in files
    assert json.loads(next(iter(files.values())))["bf16"]["enabled"] is True
    assert "mixed_precision" not in ds  # accelerate refuses it beside a config file


def test_deepspeed_export_is_accepted_by_deepspeed_config():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    spec = load_spec({"backend": "fsdp", "shard": "grad_op", "offload": "params",
                      "micro_batch_size": 2, "grad_accum_steps": 3})
    with pytest.raises(SpecError, match="offload"):  # FSDP's params offload has no ZeRO-2 twin
        export_to("deepspeed", spec)
    spec = load_spec({"backend": "deepspeed", "shard": "full", "offload": "optimizer",
                      "micro_batch_size": 2, "grad_accum_steps": 3, "precision": "bf16"})
    config = DeepSpeedConfig(json.loads(json.dumps(export_to("deepspeed", spec))))
    assert config.zero_optimization_stage == 3 and config.gradient_accumulation_steps == 3
    assert from_deepspeed(export_to("deepspeed", spec))[0]["shard"] == "full"


@pytest.mark.parametrize("data", [
    {"backend": "fsdp", "shard": "full", "wrap": {"policy": "layer_classes",
                                                   "layer_classes": ["LlamaDecoderLayer"]}},
    {"backend": "fsdp", "shard": "grad_op", "fsdp": {"version": 1}},
    {"backend": "deepspeed", "shard": "optimizer"},
    {"backend": "xla_fsdp", "xla": {"fsdp_version": 1, "xla_fsdp_grad_ckpt": True}},
    {"backend": "xla_fsdp", "xla": {"fsdp_version": 2}},
])
def test_hf_trainer_arguments_build_training_arguments(tmp_path, monkeypatch, data):
    """TrainingArguments built from the export, in the environment it names, hands accelerate the
    FSDP version the spec says (accelerate's own plugin reads it; FSDP2 was silently FSDP1)."""
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    document = export_to("hf-trainer", load_spec(data))
    assert set(document) == {"training_arguments", "environment"}
    # TrainingArguments exports FSDP_* variables itself: the whole environment is restored after
    monkeypatch.setattr(os, "environ", os.environ.copy())
    monkeypatch.setenv("FSDP_VERSION", "2" if data.get("fsdp", {}).get("version") == 1 else "1")
    for key, value in document["environment"].items():
        monkeypatch.setenv(key, value)
    for key in [k for k in os.environ if k.startswith("FSDP_") and k != "FSDP_VERSION"]:
        monkeypatch.delenv(key)
    args = TrainingArguments(output_dir=str(tmp_path), **document["training_arguments"])
    if data["backend"] == "xla_fsdp":
        assert args.fsdp_config["xla"] is True
        assert args.fsdp_config["xla_fsdp_v2"] == (data["xla"]["fsdp_version"] == 2)
    elif data["backend"] == "deepspeed":
        assert args.deepspeed["zero_optimization"]["stage"] == 1
    else:
        from accelerate.utils import FullyShardedDataParallelPlugin

        version = data.get("fsdp", {}).get("version", 2)
        # transformers 5: the plugin is built from fsdp_plugin_args (Trainer.create_accelerator_...)
        with gpu_host():
            plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
        assert plugin.fsdp_version == version
        if version == 2:
            assert plugin.reshard_after_forward is (data["shard"] == "full")
        else:
            assert plugin.reshard_after_forward.name == {"full": "FULL_SHARD",
                                                         "grad_op": "SHARD_GRAD_OP"}[data["shard"]]


@pytest.mark.parametrize("dynamo", [
    {"dynamo_backend": "INDUCTOR"},
    {"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune", "dynamo_use_fullgraph": True,
     "dynamo_use_dynamic": True, "dynamo_use_regional_compilation": True},
    {"dynamo_backend": "AOT_EAGER", "dynamo_use_regional_compilation": False},
])
def test_dynamo_config_means_what_accelerate_launch_makes_of_it(monkeypatch, dynamo):
    """The oracle: accelerate launch copies dynamo_config onto its --dynamo_* arguments (defaults
    mode default, fullgraph/dynamic/regional False), exports them as ACCELERATE_DYNAMO_*, and its
    TorchDynamoPlugin reads them back."""
    from accelerate.utils import TorchDynamoPlugin

    launch = {"dynamo_mode": "default", "dynamo_use_fullgraph": False, "dynamo_use_dynamic": False,
              "dynamo_use_regional_compilation": False, **dynamo}
    for key, value in launch.items():
        monkeypatch.setenv(f"ACCELERATE_{key.upper()}", str(value))
    plugin = TorchDynamoPlugin()
    compiled = load_spec(from_accelerate({**FSDP, "dynamo_config": dynamo})[0]).compile
    assert compiled.enabled and compiled.backend == plugin.backend.value.lower()
    assert (compiled.mode, compiled.fullgraph, compiled.dynamic) == (
        plugin.mode, plugin.fullgraph, plugin.dynamic)
    assert (compiled.scope == "blocks") == plugin.use_regional_compilation


def test_dynamo_backends_polyshard_has_not_are_refused_naming_the_field():
    assert "dynamo_config.dynamo_backend" in problems(
        from_accelerate, {**FSDP, "dynamo_config": {"dynamo_backend": "TVM"}})
    off = load_spec(from_accelerate({**FSDP, "dynamo_config": {"dynamo_backend": "NO"}})[0])
    assert not off.compile.enabled


def test_compile_exports_to_accelerate_and_imports_back():
    spec = load_spec({"compile": {"enabled": True, "dynamic": False, "fullgraph": True}})
    cfg = export_to("accelerate", spec)
    assert cfg["dynamo_config"]["dynamo_use_regional_compilation"] is True
    assert load_spec(from_accelerate(cfg)[0]).compile == spec.compile
    assert "compile.dynamic" in problems(export_to, "accelerate", load_spec({"compile": True}))


def test_zero2_with_offload_param_means_what_deepspeed_does_with_it():
    """A public accelerate config (ChatLM-mini-Chinese's README): ZeRO-2, both offload devices cpu,
    dynamo INDUCTOR. DeepSpeed reads offload_param at stage 3 only, so this is ZeRO-2 with optimizer
    offload, compiled; it used to be refused."""
    cfg = {"distributed_type": "DEEPSPEED", "num_processes": 8, "mixed_precision": "bf16",
           "deepspeed_config": {"gradient_accumulation_steps": 8, "gradient_clipping": 1.0,
                                "offload_optimizer_device": "cpu", "offload_param_device": "cpu",
                                "zero3_init_flag": False, "zero_stage": 2},
           "dynamo_config": {"dynamo_backend": "INDUCTOR"}}
    data, report = from_accelerate(cfg)
    spec = load_spec(data)
    assert (spec.shard, spec.offload, spec.compile.enabled) == ("grad_op", "optimizer", True)
    assert any(r[0] == "zero_optimization.offload_param" and r[1] == "ignored" for r in report)


def test_parallelism_objects_import_as_their_tools_resolve_them():
    """accelerate's ParallelismConfig (through the accelerate file reader) and transformers'
    DistributedConfig (object, or its JSON through transformers' own from_dict): the spec's
    dimensions are the sizes each class resolved; what polyshard cannot keep is named."""
    from accelerate.parallelism_config import ParallelismConfig
    from transformers.distributed import DistributedConfig

    from parallel.interop.accelerate import from_parallelism_config
    from parallel.interop.distributed_config import from_distributed_config as read

    def from_distributed_config(config, **kwargs):
        return read(config, load_spec, **kwargs)

    theirs = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2)
    spec = load_spec(from_parallelism_config(theirs)[0])
    assert (spec.dims.dp_replicate, spec.dims.dp_shard, spec.dims.tp) == (2, 2, 2)
    assert spec.world_size == theirs.total_size and spec.shard == "hybrid"
    world = {"topology": {"procs_per_node": 8}}
    for given in (DistributedConfig(tp_size=2, fsdp_size=2, dp_replicate_size=2),
                  {"tp_size": 2, "fsdp_size": 2, "dp_replicate_size": 2}):
        resolved = given if isinstance(given, DistributedConfig) else DistributedConfig.from_dict(given)
        out, _ = from_distributed_config(given, given=world)
        dims = load_spec({**out, "topology": {**out["topology"], "procs_per_node": 8}}).dims
        assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp) == (
            resolved.dp_replicate_size, resolved.fsdp_size, resolved.tp_size, resolved.pp_size)
    ep, _ = from_distributed_config(DistributedConfig(fsdp_size=4, ep_size=2),
                                    given={"topology": {"procs_per_node": 4}})
    assert ep["topology"]["ep"] == 2
    assert "fsdp_mixed_precision" in problems(from_distributed_config,
                                              {"fsdp_size": 2, "fsdp_mixed_precision": True})
    assert "bogus" in problems(from_distributed_config, {"fsdp_size": 2, "bogus": 1})
    legacy = DistributedConfig(tp_size=2, ep_size=2, tp_plan={})  # ep over the tp ranks alone
    assert "tp_plan" in problems(from_distributed_config, legacy)
