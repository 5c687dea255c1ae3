"""`sequence.loss_tile` (parallel/engine/model/tiled_loss.py) and `sequence.offload_activations`: the
tiled loss and its gradients are the model's own (1e-6) on a Llama, a GQA Qwen2 with tied
embeddings, GPT-2 and a Mixtral with its router loss, with padded labels and tiles that do not divide
the tokens; models whose logits change after lm_head are refused; through the engine, both fields
train the same step as without them."""

import pytest
import torch
import transformers

from parallel import create_engine, load_spec
from parallel.engine.model.tiled_loss import apply_tiled_loss
from parallel.spec.errors import SpecError

SMALL = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=64)
MODELS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", SMALL),
    "qwen2-gqa-tied": ("Qwen2ForCausalLM", "Qwen2Config",
                       dict(SMALL, num_key_value_heads=2, tie_word_embeddings=True)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4)),
    "mixtral-router-loss": ("MixtralForCausalLM", "MixtralConfig",
                            dict(SMALL, num_local_experts=4, num_key_value_heads=2, output_router_logits=True,
                                 router_aux_loss_coef=0.02)),
}


def build(name):
    cls, config, kw = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, config)(**kw))
    model.config._attn_implementation = "eager"
    return model.eval()  # GPT-2's dropout off: one forward and the next see the same model


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (3, 23), generator=g)
    labels = ids.clone()
    labels[0, 15:] = -100  # padding
    labels[2, :9] = -100  # a prompt
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tile", [16, 7, 1000])
def test_the_tiled_loss_and_gradients_are_the_models_own(name, tile):
    model = build(name)
    reference = model(**batch()).loss
    reference.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    tiled = apply_tiled_loss(model, tile, has_loss_fn=False)
    outputs, loss = tiled.forward(model, batch())
    assert outputs.logits is None and "logits" not in outputs  # the loss is not handed out as logits
    loss.backward()
    assert abs(loss.item() - reference.item()) < 1e-6, (loss.item(), reference.item())
    for n, p in model.named_parameters():
        if n in want:
            assert torch.allclose(p.grad, want[n], atol=1e-6, rtol=0), n
    # without labels the head is itself (generation, a forward of your own)
    assert model(input_ids=batch()["input_ids"]).logits.shape == (3, 23, 96)


def test_models_whose_logits_change_after_lm_head_are_refused():
    gemma = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **dict(SMALL, head_dim=8, num_key_value_heads=2), final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="softcapped"):
        apply_tiled_loss(gemma, 16, has_loss_fn=False)
    bert = transformers.BertForMaskedLM(transformers.BertConfig(**SMALL))
    with pytest.raises(ValueError, match="not a causal LM"):
        apply_tiled_loss(bert, 16, has_loss_fn=False)
    # a logit scale applied after lm_head (as Cohere's is): found at the first forward
    model = build("llama")
    tiled = apply_tiled_loss(model, 16, has_loss_fn=False)
    forward = model.forward
    model.forward = lambda **kw: forward(**kw).__class__(logits=forward(**kw).logits * 2)
    with pytest.raises(RuntimeError, match="changes its logits after"):
        tiled.forward(model, batch())


def test_tp_with_a_tiled_loss_is_refused_naming_both():
    with pytest.raises(SpecError, match="sequence.loss_tile"):
        load_spec({"sequence": {"loss_tile": 64}, "topology": {"procs_per_node": 2, "tp": 2}})
    with pytest.raises(SpecError, match="sequence.offload_activations"):
        load_spec({"backend": "xla_fsdp", "sequence": {"offload_activations": True}})


def steps(spec: dict, n=2) -> list[float]:
    """The losses of n steps, then evaluate's loss and token accuracy (a metric reading logits)."""
    from parallel.engine.infer.evaluate import token_accuracy

    engine = create_engine(load_spec({"backend": "fsdp", "micro_batch_size": 3, **spec}))
    try:
        engine.prepare(build("llama"), (torch.optim.AdamW, {"lr": 1e-2}))
        losses = [engine.train_step(batch(seed)).loss for seed in range(n)]
        results = engine.evaluate([batch(7)], metrics=[token_accuracy])
        return losses + [results["loss"], results["token_accuracy"]]
    finally:
        engine.close()


def test_through_the_engine_both_fields_train_the_same_steps():
    plain = steps({})
    assert max(abs(a - b) for a, b in zip(steps({"sequence": {"loss_tile": 16}}), plain)) < 1e-6
    assert steps({"sequence": {"offload_activations": True},
                  "activation_checkpointing": True}) == steps({"activation_checkpointing": True})
