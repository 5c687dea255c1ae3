"""DeepSpeed AutoTP as `topology.tp` (backends/deepspeed/config/autotp.py, import_tp.py): the plan polyshard
hands AutoTP splits exactly what the plan says by DeepSpeed's own matcher, a partition_config reads
back as the plan it is, and DeepSpeed files with AutoTP import and export keeping their meaning."""

import functools
import json

import pytest
from transformers import MixtralConfig, MixtralForCausalLM

from backends.deepspeed.config.autotp import STYLE_OF, fnmatch_of, partition_config, plan_of
from backends.deepspeed.files import interop as ds_interop
from parallel.engine.model.tp_plan import KEPT_WHOLE, RENAMED, hf_tp_plan, resolve_plan, style_of
from parallel.interop.accelerate import from_accelerate
from parallel.interop.export import export
from parallel.spec.io import SpecError, load_spec
from parallel.toy import build_llama, llama_config

from_deepspeed = functools.partial(ds_interop.from_deepspeed, validate=load_spec)  # the CLI's validation


def export_to(fmt, spec):
    return export(spec, fmt)


def models():
    yield build_llama(llama_config("tiny"))
    yield MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2,
                                           num_local_experts=2, vocab_size=64))


def ds_style(spec) -> str | None:
    """What AutoTP makes of a weight its matcher found a spec for (None: left whole)."""
    if spec is None or spec.partition_type.value == "skip":
        return None
    return STYLE_OF[(spec.partition_type.value, spec.gather_output)]


@pytest.mark.parametrize("model", models(), ids=["llama", "mixtral"])
def test_autotp_splits_what_the_plan_splits_by_deepspeeds_own_matcher(model):
    pytest.importorskip("deepspeed")
    from deepspeed.module_inject.autotp_config import AutoTPConfig
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

    plan = resolve_plan(model, 2, None)
    ours = AutoTPConfig.from_dict(partition_config(plan))
    # what DeepSpeed would split by on its own: the model's HF plan through its converter
    theirs = AutoTPConfig(layer_specs=TPPlanConverter.convert(_get_hf_tp_plan(model)))
    weights = [n for n, p in model.named_parameters() if n.endswith(".weight")]
    for name in weights:
        mine = style_of(name.removesuffix(".weight"), plan)
        assert ds_style(ours.find_matching_spec(name)) == mine, name
        assert ds_style(theirs.find_matching_spec(name)) == mine, name  # the same split
    assert sum(style_of(n.removesuffix(".weight"), plan) is not None for n in weights) > 4
    # and each of DeepSpeed's converted patterns reads back as a module path pattern
    for spec in theirs.layer_specs:
        for regex in spec.patterns:
            back = fnmatch_of(regex)
            assert all((style_of(n.removesuffix(".weight"), {back: "colwise"}) is not None) ==
                       bool(spec.matches(n)) for n in weights), (regex, back)


def test_a_partition_config_reads_back_as_the_plan_or_is_refused_naming_why():
    plan = resolve_plan(build_llama(llama_config("tiny")), 2, None)
    assert plan_of(partition_config(plan)) == plan  # polyshard's own export, exactly
    hand = {"layer_specs": [{"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"},
                            {"patterns": [r".*\.[qkv]_proj\.weight$"], "partition_type": "column"}]}
    assert plan_of(hand) == {"*.o_proj": "rowwise", "*.[qkv]_proj": "colwise"}
    for bad, words in (({"layer_specs": [{"patterns": [r".*\.(q|k)_proj\.weight$"]}]}, "syntax"),
                       ({"layer_specs": [{"patterns": [r".*\.q_proj$"]}]}, r"\.weight"),
                       ({"layer_specs": [{"patterns": ["x\\.weight$"], "shape": [3, -1]}]}, "whole"),
                       ({"layer_specs": [{"patterns": ["x\\.weight$"], "partition_type": "skip"}]},
                        "whole"),
                       ({"lm_head_patterns": ["out"]}, "head")):
        with pytest.raises(ValueError, match=words):
            plan_of(bad)


def test_a_deepspeed_file_with_autotp_imports_with_its_global_batch_and_plan():
    """DeepSpeedConfig counts train_batch_size over every rank when a config file alone enables
    AutoTP (no mpu): 8 at micro-batch 2 on 4 ranks of tp 2 is 4 distinct samples per step."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 8,
           "zero_optimization": {"stage": 2},
           "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True, "partition_config": {
               "layer_specs": [{"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"}]}}}
    data, _ = from_deepspeed(cfg, given={"topology": {"procs_per_node": 4}})
    spec = load_spec({**data, "topology": {**data["topology"], "procs_per_node": 4}})
    assert (spec.topology.tp, spec.global_batch_size, spec.dims.dp_size) == (2, 4, 2)
    assert spec.topology.tp_plan == {"*.o_proj": "rowwise"}
    assert spec.deepspeed.native["tensor_parallel"] == {"tp_overlap_comm": True}
    off, report = from_deepspeed({"tensor_parallel": {"autotp_size": 1}})
    assert "topology" not in off and ("tensor_parallel", "ignored") in [r[:2] for r in report]
    for block, field in (({"autotp_size": 2, "preset_model": "llama"}, "preset_model"),
                         ({"autotp_size": 2, "vocab_parallel_lm_head": True},
                          "vocab_parallel_lm_head"),
                         ({"autotp_size": 2, "tp": {"tp_grain_size": 64}}, "tp")):
        with pytest.raises(SpecError) as err:
            from_deepspeed({"tensor_parallel": block})
        assert f"tensor_parallel.{field}" in dict(err.value.problems), block
    with pytest.raises(SpecError) as err:  # 3 per-rank samples over 2 TP ranks: no whole count
        from_deepspeed({"train_micro_batch_size_per_gpu": 1, "train_batch_size": 3,
                        "tensor_parallel": {"autotp_size": 2}})
    assert "does not divide it" in dict(err.value.problems)["train_batch_size"]


def test_autotp_exports_to_deepspeed_and_back_and_deepspeed_accepts_it():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    data = {"backend": "deepspeed", "shard": "optimizer", "micro_batch_size": 2,
            "topology": {"procs_per_node": 4, "tp": 2,
                         "tp_plan": {"model.layers.*.mlp.down_proj": "rowwise"}}}
    exported = export_to("deepspeed", load_spec(data))
    config = DeepSpeedConfig(json.loads(json.dumps(exported)))  # its own parser takes it
    assert config.tensor_parallel_config.autotp_size == 2
    assert config.tensor_parallel_config.get_partition_config_object().layer_specs
    back, _ = from_deepspeed(exported, given={"topology": {"procs_per_node": 4}})
    assert back["topology"]["tp"] == 2 and back["topology"]["tp_plan"] == data["topology"]["tp_plan"]


def test_accelerate_runs_deepspeed_autotp_at_tp_equal_to_the_world_only():
    """accelerate 1.11 builds DeepSpeed's TP mesh over the first tp ranks (measured: the others
    fail), and refuses a ParallelismConfig beside DEEPSPEED: export and import say so."""
    pure = {"backend": "deepspeed", "shard": "grad_op", "topology": {"procs_per_node": 2, "tp": 2}}
    out = export_to("accelerate", load_spec(pure))
    assert json.loads(next(iter(out["__files__"].values())))["tensor_parallel"]["autotp_size"] == 2
    mixed = {**pure, "topology": {"procs_per_node": 4, "tp": 2}}
    for tool in ("accelerate", "hf-trainer"):
        with pytest.raises(SpecError) as err:
            export_to(tool, load_spec(mixed))
        assert "topology.tp" in dict(err.value.problems), tool
    with pytest.raises(SpecError) as err:
        from_accelerate({"distributed_type": "DEEPSPEED", "num_processes": 4,
                         "deepspeed_config": {"zero_stage": 2},
                         "parallelism_config": {"parallelism_config_tp_size": 2}})
    assert "parallelism_config" in dict(err.value.problems)


def test_the_models_own_plan_is_what_deepspeed_reads_as_the_hf_plan():
    model = build_llama(llama_config("tiny"))
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan

    # transformers 5 names colwise_rep colwise_gather_output, and adds the embedding as
    # embedding_rowwise, which AutoTP with vocab_parallel_lm_head false keeps whole, as polyshard does
    theirs = {k: RENAMED.get(v, v) for k, v in _get_hf_tp_plan(model).items() if v not in KEPT_WHOLE}
    assert {k.split(".")[-1]: v for k, v in hf_tp_plan(model).items()} == {
        k.split(".")[-1]: v for k, v in theirs.items()}
