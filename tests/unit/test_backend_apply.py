"""DeepSpeed's and XLA SPMD's set-up steps that are plain functions of the model and the config,
each alone on a meta-device model (backends/deepspeed/runtime/parallelize.py, backends/xla/spmd.py); what
needs the runtime (deepspeed.initialize, mark_sharding) runs in tests/distributed."""

import torch

from backends.deepspeed.runtime.parallelize import apply_autotp_plan, known_config
from backends.xla.spmd import tp_shardings
from parallel.engine.model.tp_plan import resolve_plan
from parallel.toy import build_llama, llama_config


def meta_llama(**overrides):
    with torch.device("meta"):
        return build_llama(llama_config("tiny", **overrides))


def test_zero_init_sees_no_model_sized_auto():
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 5}}
    known = known_config(config)
    assert known["zero_optimization"] == {"stage": 3, "stage3_prefetch_bucket_size": 5}
    assert config["zero_optimization"]["reduce_bucket_size"] == "auto"  # the original untouched


def test_autotp_gets_the_checked_plan_and_every_split_shape():
    model = meta_llama()
    plan = resolve_plan(model, 2, None, lambda message: None)
    config, expected = apply_autotp_plan({"tensor_parallel": {"autotp_size": 2}}, model, 2, plan)
    specs = config["tensor_parallel"]["partition_config"]["layer_specs"]
    assert specs and config["tensor_parallel"]["autotp_size"] == 2
    q = model.model.layers[0].self_attn.q_proj.weight
    assert expected["model.layers.0.self_attn.q_proj.weight"] == (q.shape[0] // 2, q.shape[1])
    o = model.model.layers[0].self_attn.o_proj.weight
    assert expected["model.layers.0.self_attn.o_proj.weight"] == (o.shape[0], o.shape[1] // 2)
    embed = model.model.embed_tokens.weight
    assert expected["model.embed_tokens.weight"] == tuple(embed.shape)  # not in the plan: whole


def test_spmd_shardings_follow_the_plan_and_shard_the_rest_over_both_axes():
    model = meta_llama()
    plan = resolve_plan(model, 2, None, lambda message: None)
    specs = tp_shardings(model, plan)
    assert specs["model.layers.0.self_attn.q_proj.weight"] == ("model", "fsdp")  # colwise
    assert specs["model.layers.0.self_attn.o_proj.weight"] == ("fsdp", "model")  # rowwise
    # torch_xla 2.9's SPMD save planner drops partly replicated tensors: the rest over both axes
    assert specs["model.embed_tokens.weight"] == (("fsdp", "model"), None)
    assert specs["model.norm.weight"] == (("fsdp", "model"),)
    assert set(specs) == {n for n, _ in model.named_parameters()}


def test_a_tied_head_is_sharded_once():
    model = meta_llama(tie_word_embeddings=True)
    specs = tp_shardings(model, resolve_plan(model, 2, None, lambda message: None))
    assert "lm_head.weight" not in specs  # the same tensor as the embedding, named once
