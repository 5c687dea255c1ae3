"""accelerate / DeepSpeed / HF Trainer interop: the seed's accelerate config converts field by field;
exported files are accepted by the tools' own config classes; import after export is a round trip."""

import json

import pytest
import yaml

from parallel.interop import from_accelerate, from_deepspeed
from parallel.interop_export import to_accelerate, to_deepspeed, to_hf_trainer
from parallel.specio import load_spec

DATA = __import__("pathlib").Path(__file__).with_name("data")


def test_the_seed_accelerate_config_converts_every_field():
    cfg = yaml.safe_load((DATA / "accelerate_fsdp_seed.yaml").read_text())
    data, report = from_accelerate(cfg)
    spec = load_spec(data)
    fields = {f.split(".")[-1] for f, _, _ in report}
    assert set(cfg) - {"fsdp_config"} <= fields and set(cfg["fsdp_config"]) <= fields
    assert not [r for r in report if r[1] == "unsupported"], report
    assert (spec.backend, spec.shard, spec.offload, spec.precision) == ("fsdp", "full", "params",
                                                                        "bf16")
    assert spec.wrap.layer_classes == ["BertLayer"] and spec.fsdp.version == 1
    assert spec.topology.procs_per_node == 2 and spec.state_dict == "sharded"


@pytest.mark.parametrize("value,shard", [(1, "full"), ("2", "grad_op"), ("NO_SHARD", "none"),
                                         (4, "hybrid"), ("HYBRID_SHARD_ZERO2", "hybrid_grad_op")])
def test_sharding_strategy_as_number_or_name(value, shard):
    data, _ = from_accelerate({"distributed_type": "FSDP", "num_processes": 4,
                               "fsdp_config": {"fsdp_sharding_strategy": value}})
    assert data["shard"] == shard


def test_xla_keys_select_xla_fsdp():
    data, report = from_accelerate({"distributed_type": "FSDP", "xla": True, "fsdp_config": {
        "fsdp_sharding_strategy": 1, "xla_fsdp_settings": {"flatten_parameters": False},
        "xla_fsdp_grad_ckpt": True}})
    spec = load_spec(data)
    assert spec.backend == "xla_fsdp" and spec.checkpoint_activations
    assert spec.xla.xla_fsdp_settings == {"flatten_parameters": False}


def test_unknown_fields_are_reported_not_dropped():
    _, report = from_accelerate({"distributed_type": "FSDP", "mixed_precision": "fp8",
                                 "fsdp_config": {"fsdp_magic": 1}})
    bad = {f for f, outcome, _ in report if outcome == "unsupported"}
    assert bad == {"mixed_precision", "fsdp_config.fsdp_magic"}


def test_deepspeed_json_with_auto_values():
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4,
           "gradient_clipping": 1.0, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "overlap_comm": True, "reduce_bucket_size": "auto"},
           "steps_per_print": 10}
    data, report = from_deepspeed(cfg)
    spec = load_spec(data)
    assert (spec.shard, spec.offload, spec.precision, spec.grad_accum_steps) == (
        "full", "optimizer", "bf16", 4)
    assert spec.deepspeed.native == {"zero_optimization": {"overlap_comm": True}}
    assert {f for f, o, _ in report if o == "auto"} == {"train_micro_batch_size_per_gpu",
                                                        "zero_optimization.reduce_bucket_size"}


def test_accelerate_export_loads_in_accelerate_and_round_trips(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import ClusterConfig

    spec = load_spec({"backend": "fsdp", "shard": "hybrid", "precision": "bf16",
                      "wrap": {"policy": "layer_classes", "layer_classes": ["LlamaDecoderLayer"]},
                      "topology": {"nodes": 2, "procs_per_node": 4}, "fsdp": {"version": 2}})
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(to_accelerate(spec)))
    cluster = ClusterConfig.from_yaml_file(str(path))
    assert cluster.distributed_type == "FSDP" and cluster.num_processes == 8
    back = load_spec(from_accelerate(yaml.safe_load(path.read_text()))[0])
    for field in ("backend", "shard", "precision", "offload", "wrap", "topology", "state_dict"):
        assert getattr(back, field) == getattr(spec, field), field
    assert back.fsdp.version == 2


def test_deepspeed_export_is_accepted_by_deepspeed_config():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    spec = load_spec({"backend": "fsdp", "shard": "grad_op", "offload": "params",
                      "micro_batch_size": 2, "grad_accum_steps": 3})
    with pytest.raises(Exception, match="offload"):  # FSDP's params offload has no ZeRO-2 twin
        to_deepspeed(spec)
    spec = load_spec({"backend": "deepspeed", "shard": "full", "offload": "optimizer",
                      "micro_batch_size": 2, "grad_accum_steps": 3, "precision": "bf16"})
    config = DeepSpeedConfig(json.loads(json.dumps(to_deepspeed(spec))))
    assert config.zero_optimization_stage == 3 and config.gradient_accumulation_steps == 3
    assert from_deepspeed(to_deepspeed(spec))[0]["shard"] == "full"


@pytest.mark.parametrize("data", [
    {"backend": "fsdp", "shard": "full", "wrap": {"policy": "layer_classes",
                                                   "layer_classes": ["LlamaDecoderLayer"]}},
    {"backend": "deepspeed", "shard": "optimizer"},
    {"backend": "xla_fsdp", "xla": {"fsdp_version": 1, "xla_fsdp_grad_ckpt": True}},
    {"backend": "xla_fsdp", "xla": {"fsdp_version": 2}},
])
def test_hf_trainer_arguments_build_training_arguments(tmp_path, data):
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    kwargs = to_hf_trainer(load_spec(data))
    args = TrainingArguments(output_dir=str(tmp_path), **kwargs)
    if data["backend"] == "xla_fsdp":
        assert args.fsdp_config["xla"] is True
        assert args.fsdp_config["xla_fsdp_v2"] == (data["xla"]["fsdp_version"] == 2)
    elif data["backend"] == "deepspeed":
        assert args.deepspeed["zero_optimization"]["stage"] == 1
    else:
        assert "full_shard" in [str(o.value) for o in args.fsdp]


def test_bad_input_exits_2_naming_the_field(tmp_path, capsys):
    from parallel.cli import main

    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 7}}')
    assert main(["import", "deepspeed", str(tmp_path / "ds.json")]) == 2
    assert "zero_optimization.stage: 7 is no ZeRO stage" in capsys.readouterr().err
    assert main(["import", "accelerate", str(tmp_path / "missing.yaml")]) == 2
