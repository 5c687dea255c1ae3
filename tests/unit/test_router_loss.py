"""The router's load-balancing loss over the global batch (parallel/engine/model/moe/router.py), on the
four Hugging Face families that compute one (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), padded rows
with a 2-D attention mask: one process's loss and gradients equal the model's own
(`output_router_logits=True`), and the loss summed from ranks' shares of a split batch equals the
model's function on the whole batch, where the mean of per-rank losses does not."""

import importlib

import pytest
import torch

from parallel.engine.model.moe.experts import router_blocks
from parallel.engine.model.moe.router import RouterLoss, balancing_loss, statistics

COMMON = dict(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, num_experts_per_tok=2,
              output_router_logits=True, router_aux_loss_coef=0.5, max_position_embeddings=64)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 8, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 8,
                                                            "moe_intermediate_size": 8}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 8}),
}


def build(family):
    import transformers

    config, model, extra = FAMILIES[family]
    torch.manual_seed(0)
    return getattr(transformers, model)(getattr(transformers, config)(**COMMON, **extra))


def padded_batch(rows=4, length=12):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    for r, keep in enumerate((12, 7, 3, 10)[:rows]):
        mask[r, keep:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_process_equals_the_models_own_loss_and_gradients(family):
    model, batch = build(family), padded_batch()
    theirs = model(**batch).loss  # language-model loss + coef x the model's balancing loss
    theirs.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    router = RouterLoss.for_model(model, router_blocks(model), "global", 1, has_loss_fn=False)
    with router.capture():
        ours = model(**batch, output_router_logits=False).loss
    ours = ours + router.share(batch["attention_mask"], 1, group=None)
    ours.backward()
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), abs=1e-6)
    for n, p in model.named_parameters():
        if n in expected:
            torch.testing.assert_close(p.grad, expected[n], atol=1e-6, rtol=1e-5, msg=n)
    router.close()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ranks_shares_add_up_to_the_global_batchs_loss(family):
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    model, batch = build(family), padded_batch()
    with torch.no_grad():
        logits = model(**batch).router_logits
    whole = module.load_balancing_loss_func(logits, 8, 2, batch["attention_mask"])
    # two ranks of two rows each: every layer's logits are [rows x length, E], rows in order
    halves = [tuple(layer.view(4, 12, 8)[r:r + 2].reshape(-1, 8) for layer in logits)
              for r in (0, 2)]
    masks = [batch["attention_mask"][r:r + 2] for r in (0, 2)]
    stats = [statistics(torch.cat(h), 2, m) for h, m in zip(halves, masks)]
    counts, n = sum(s[0] for s in stats), sum(s[1] for s in stats)
    shares = [balancing_loss(counts, n, s[2]) for s in stats]
    assert float(sum(shares)) == pytest.approx(float(whole), abs=1e-6)
    per_rank = [module.load_balancing_loss_func(h, 8, 2, m) for h, m in zip(halves, masks)]
    assert abs(float(sum(per_rank)) / 2 - float(whole)) > 1e-4  # what each rank alone computes


def test_a_router_the_engine_cannot_find_is_refused_naming_the_fix():
    model = build("mixtral")
    for _, block in router_blocks(model):
        del block.gate
    with pytest.raises(ValueError, match="moe.router_loss: rank"):
        RouterLoss.for_model(model, router_blocks(model), "global", 2, has_loss_fn=False)
    assert RouterLoss.for_model(model, router_blocks(model), "rank", 2, has_loss_fn=False) is None
