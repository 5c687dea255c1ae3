"""Every spec rule's error names the field path, the value, the rule and a fix."""

import json

import pytest
import yaml
from pydantic import ValidationError

from parallel import Spec, SpecError, dump_spec, load_spec
from parallel.spec.io import json_schema


def problems(data, overrides=()):
    with pytest.raises(SpecError) as info:
        load_spec(data, list(overrides))
    return info.value.problems


def test_defaults_are_valid_and_mean_fsdp_full_shard_fp32():
    spec = load_spec({})
    assert (spec.backend, spec.shard, spec.precision, spec.offload) == ("fsdp", "full", "fp32", "none")
    assert spec.grad_clip is None and spec.world_size == 1


@pytest.mark.parametrize("data, path, words", [
    ({"backend": "fdsp"}, "backend", ["'fdsp'", "did you mean 'fsdp'"]),
    ({"shard": "zero3"}, "shard", ["'zero3'", "full"]),
    ({"grad_clipp": 1.0}, "grad_clipp", ["unknown field", "did you mean 'grad_clip'"]),
    ({"fsdp": {"verison": 1}}, "fsdp.verison", ["unknown field", "'version'"]),
    ({"grad_accum_steps": 0}, "grad_accum_steps", ["greater than or equal to 1", "got 0"]),
    ({"grad_clip": -1}, "grad_clip", ["greater than 0", "got -1"]),
    ({"shard": "optimizer"}, "shard", ["'optimizer'", "'fsdp'", "ZeRO-1", "shard: grad_op"]),
    ({"offload": "optimizer"}, "offload", ["'optimizer'", "offload: params"]),
    ({"backend": "deepspeed", "shard": "hybrid_grad_op"}, "shard", ["hpZ", "shard: hybrid"]),
    ({"backend": "xla_fsdp", "precision": "fp16"}, "precision", ["'fp16'", "precision: bf16"]),
    ({"backend": "xla_fsdp", "offload": "params"}, "offload", ["no CPU offload"]),
    ({"backend": "xla_fsdp", "shard": "none"}, "shard", ["always shards", "grad_op"]),
    ({"wrap": {"policy": "size"}}, "wrap.min_num_params", ["needs a threshold"]),
    ({"wrap": {"policy": "layer_classes"}}, "wrap.layer_classes", ["at least one class"]),
    ({"wrap": {"min_num_params": 10}}, "wrap.min_num_params", ["only read with policy 'size'"]),
    ({"wrap": {"layer_classes": ["A"]}}, "wrap.layer_classes", ["policy: layer_classes"]),
    ({"fsdp": {"use_orig_params": False}}, "fsdp.use_orig_params", ["FSDP1", "fsdp.version: 1"]),
    ({"fsdp": {"backward_prefetch": "backward_post"}}, "fsdp.backward_prefetch", ["FSDP1"]),
    ({"fsdp": {"cpu_ram_efficient_loading": True, "sync_module_states": False}},
     "fsdp.sync_module_states", ["must be true"]),
    ({"loss_scale": {"growth_interval": 10}}, "loss_scale", ["fp16 only", "'fp32'"]),
    ({"topology": {"shard_group_size": 2}}, "topology.shard_group_size", ["hybrid"]),
    ({"shard": "hybrid", "topology": {"procs_per_node": 3, "shard_group_size": 2}},
     "topology.shard_group_size", ["does not divide", "3"]),
    ({"backend": "xla_fsdp", "activation_checkpointing": False, "xla": {"xla_fsdp_grad_ckpt": True}},
     "xla.xla_fsdp_grad_ckpt", ["contradicts activation_checkpointing"]),
    ({"checkpoint": {"hf_at_end": True}}, "checkpoint.dir", ["hf_at_end", "runs/job/ckpt"]),
])
def test_rule_errors_name_path_value_and_fix(data, path, words):
    found = dict(problems(data))
    assert path in found, found
    for word in words:
        assert word in found[path], (word, found[path])


def test_several_problems_are_reported_together():
    found = dict(problems({"backend": "xla_fsdp", "offload": "params", "precision": "fp16"}))
    assert set(found) == {"offload", "precision"}


def test_changing_backend_alone_keeps_a_valid_spec_where_supported():
    base = {"shard": "grad_op", "precision": "bf16", "grad_clip": 1.0, "activation_checkpointing": True}
    for backend in ("fsdp", "deepspeed", "xla_fsdp"):
        assert load_spec(base, [f"backend={backend}"]).backend == backend


def test_xla_grad_ckpt_alias_in_both_spellings():
    assert load_spec({"backend": "xla_fsdp", "xla": {"xla_fsdp_grad_ckpt": True}}).checkpoint_activations
    spec = load_spec({"backend": "xla_fsdp", "xla": {"xla_fsdp_settings": {"xla_fsdp_grad_ckpt": True}}})
    assert spec.checkpoint_activations


def test_hybrid_shard_group_defaults_to_procs_per_node():
    spec = load_spec({"shard": "hybrid", "topology": {"nodes": 2, "procs_per_node": 4}})
    assert spec.shard_group_size == 4 and spec.world_size == 8


def test_overrides_parse_yaml_values_and_nested_paths():
    spec = load_spec({}, ["backend=deepspeed", "grad_clip=0.5", "topology.procs_per_node=2",
                          "wrap.policy=layer_classes", "wrap.layer_classes=[LlamaDecoderLayer]"])
    assert spec.backend == "deepspeed" and spec.grad_clip == 0.5 and spec.world_size == 2
    assert spec.wrap.layer_classes == ["LlamaDecoderLayer"]
    assert "field.path=value" in dict(problems({}, ["nonsense"]))["nonsense"]


def test_yaml_and_json_files_and_round_trip(tmp_path):
    data = {"backend": "deepspeed", "shard": "optimizer", "precision": "bf16",
            "topology": {"procs_per_node": 2}, "deepspeed": {"native": {"wall_clock_breakdown": True}}}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "a.json").write_text(json.dumps(data))
    a, b = load_spec(tmp_path / "a.yaml"), load_spec(tmp_path / "a.json")
    assert a == b
    dumped = dump_spec(a)
    assert yaml.safe_load(dumped) == data  # what the user wrote, nothing added
    assert load_spec(yaml.safe_load(dump_spec(a, full=True))) == a


def test_file_errors_are_spec_errors(tmp_path):
    assert "no such file" in dict(problems(tmp_path / "missing.yaml"))[str(tmp_path / "missing.yaml")]
    bad = tmp_path / "bad.yaml"
    bad.write_text("backend: [unclosed")
    assert "not valid YAML" in dict(problems(bad))[str(bad)]
    bad.write_text("- a list")
    assert "mapping" in dict(problems(bad))[str(bad)]


def test_json_schema_documents_every_field():
    schema = json_schema()
    assert schema["properties"]["backend"]["enum"] == ["fsdp", "deepspeed", "xla_fsdp"]

    def walk(props, where):
        for name, prop in props.items():
            assert prop.get("description"), f"{where}.{name} has no description"

    walk(schema["properties"], "spec")
    for name, sub in schema["$defs"].items():
        walk(sub.get("properties", {}), name)


def test_spec_is_immutable_in_meaning_assignment_is_validated():
    spec = Spec()
    with pytest.raises(ValidationError):
        spec.shard = "bogus"
