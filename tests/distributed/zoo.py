"""Models people actually train, tiny and download-free, each with its batches and its reference.

Every entry gives: how to build the model (from the current seed), the spec fields it needs (a wrap
policy), the global batches, the loss function (None: the model's own `.loss`), and how the optimizer
is built. Dropout is off so that every backend computes the same numbers as one process.

- gpt2: GPT-2 with the LM head tied to the token embedding.
- t5: an encoder-decoder; `shared`, both `embed_tokens` and `lm_head` are one tensor.
- bert: BERT masked-LM (decoder tied to the word embedding, `_no_split_modules` empty, so the wrap
  policy names BertLayer); a different number of masked positions in every row.
- mlp: a plain nn.Module with tuple batches (features, class) and its own loss.
- frozen: a Llama whose embedding and first decoder layer are frozen (requires_grad False).
- groups: a Llama with two optimizer param groups built from `named_parameters()` before `prepare`,
  the usual habit: no weight decay and another lr for biases and norms.
- padded: a Llama on SFT-style rows (prompt and padding at -100, a different number of targets per
  row, one row with none), with gradient accumulation, and an optimizer factory that splits its
  groups by `p.dim()` (FSDP1's flat views used to put every parameter in the no-decay group).
- lora: a Llama with a peft LoRA adapter on q_proj and v_proj (the base frozen); its checkpoints
  are exported --to hf (merged) and --to peft and loaded back with from_pretrained.
- mixtral, qwen2moe: mixture-of-experts (16 experts, top-1 / top-2, few tokens per rank), so ranks
  route to different experts and some experts get no token in a step; both with their router's
  load-balancing loss (output_router_logits, coefficient 0.1), which one process computes over the
  global batch; qwen2moe's rows right-padded with an attention mask the balancing loss reads.
"""

from __future__ import annotations

import torch
from torch import nn

SEQ, VOCAB, CLASSES = 16, 256, 8


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyNet(nn.Module):
    """No Hugging Face anything: returns logits; the loss comes from `mlp_loss`."""

    def __init__(self, width: int = 32, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(SEQ, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def mlp_loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ * 2, n_embd=32, n_layer=2,
                                      n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                                               num_layers=2, num_heads=4, dropout_rate=0.0,
                                               decoder_start_token_id=0))


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=64,
                                      max_position_embeddings=SEQ * 2, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0))


def _llama():
    from parallel.toy import build_llama, llama_config

    return build_llama(llama_config("tiny"))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=16, num_experts_per_tok=1,
        max_position_embeddings=SEQ * 2, output_router_logits=True, router_aux_loss_coef=0.1))


def _qwen2moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=16, num_experts_per_tok=2, decoder_sparse_step=1,
        max_position_embeddings=SEQ * 2, output_router_logits=True, router_aux_loss_coef=0.1))


def by_dim(params):
    """An optimizer factory as people write them: decay on matrices, none on vectors."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=LR, weight_decay=0.1)


def _lora():
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.0)
    return peft.get_peft_model(_llama(), config)


def _frozen():
    model = _llama()
    for module in (model.model.embed_tokens, model.model.layers[0]):
        module.requires_grad_(False)
    return model


def lm_batches(steps, rows, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def t5_batches(steps, rows, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (rows, SEQ), generator=g),
             "labels": torch.randint(0, VOCAB, (rows, SEQ // 2), generator=g)}
            for _ in range(steps)]


def mlm_batches(steps, rows, seed):
    out, g = [], torch.Generator().manual_seed(seed + 7)
    for batch in lm_batches(steps, rows, seed):
        masked = torch.rand(batch["input_ids"].shape, generator=g) < 0.3  # unequal per row
        labels = torch.where(masked, batch["input_ids"], -100)
        ids = torch.where(masked, 3, batch["input_ids"])  # 3: the "mask" token
        out.append({"input_ids": ids, "labels": labels})
    return out


def padded_batches(steps, rows, seed):
    """SFT rows: a prompt (-100) of 1-5 tokens, then targets, then padding (-100) from a random
    length on; the second row of every step has no target at all."""
    g = torch.Generator().manual_seed(seed + 11)
    out = []
    for batch in lm_batches(steps, rows, seed):
        labels = batch["input_ids"].clone()
        for r in range(rows):
            prompt = int(torch.randint(1, 6, (1,), generator=g))
            end = int(torch.randint(prompt + 1, SEQ + 1, (1,), generator=g))
            labels[r, :prompt], labels[r, end:] = -100, -100
        labels[1] = -100
        out.append({"input_ids": batch["input_ids"], "labels": labels})
    return out


def masked_batches(steps, rows, seed):
    """Right-padded rows as a tokenizer pads them: an attention mask of 0 from a random length on
    (the labels -100 there), so a mixture-of-experts model's balancing loss leaves them out."""
    g = torch.Generator().manual_seed(seed + 13)
    out = []
    for batch in lm_batches(steps, rows, seed):
        mask = torch.ones_like(batch["input_ids"])
        for r in range(rows):
            mask[r, int(torch.randint(2, SEQ + 1, (1,), generator=g)):] = 0
        out.append({**batch, "attention_mask": mask, "labels": batch["labels"].masked_fill(
            mask == 0, -100)})
    return out


def tuple_batches(steps, rows, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, SEQ, generator=g), torch.randint(0, CLASSES, (rows,), generator=g))
            for _ in range(steps)]


def no_decay(name: str, param) -> bool:
    return param.dim() < 2 or name.endswith(".bias")


def usual_groups(model, lr: float):
    """The habit: groups from named_parameters() of the model as built, before prepare."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if not no_decay(n, p)]},
            {"params": [p for n, p in named if no_decay(n, p)], "weight_decay": 0.0, "lr": lr / 2}]


LR = 1e-2
ZOO = {
    "gpt2": {"build": _gpt2, "batches": lm_batches, "wrap": {"policy": "auto"}},
    "t5": {"build": _t5, "batches": t5_batches, "wrap": {"policy": "auto"}},
    "bert": {"build": _bert, "batches": mlm_batches,
             "wrap": {"policy": "layer_classes", "layer_classes": ["BertLayer"]}},
    # DeepSpeed does not wrap: `auto` on a model without _no_split_modules is no error there
    "mlp": {"build": TinyNet, "batches": tuple_batches, "loss_fn": mlp_loss,
            "wrap": {"policy": "layer_classes", "layer_classes": ["Block"]},
            "overrides": {"zero2": {"wrap": {"policy": "auto"}}}},
    "frozen": {"build": _frozen, "batches": lm_batches, "wrap": {"policy": "auto"}},
    # XLA FSDP v1 flattens a unit's parameters into one tensor, so groups that split a unit are
    # refused there (test_model_zoo asserts the refusal); per-parameter shards make them possible.
    "groups": {"build": _llama, "batches": lm_batches, "wrap": {"policy": "auto"}, "groups": True,
               "overrides": {"xla1": {"xla": {"fsdp_version": 1, "flatten_parameters": False}}}},
    "padded": {"build": _llama, "batches": padded_batches, "wrap": {"policy": "auto"},
               "accumulate": 2, "factory": by_dim,
               "overrides": {"xla1": {"xla": {"fsdp_version": 1, "flatten_parameters": False}}}},
    "lora": {"build": _lora, "batches": padded_batches, "wrap": {"policy": "auto"}},
    # MoE (moe: True) as transformers 5 builds it: each block's experts fused in 3-D tensors, which
    # every backend steps whole as one process does (an expert no token reached gets a zero row and
    # is updated on both), so flat backends (ZeRO, XLA v1) are exact here and say nothing; with
    # experts held one module each (fused: False) they update experts no rank used, say so, and
    # differ (docs/moe.md). HF's MoE blocks route with data-dependent shapes, which XLA compiles
    # anew each step (docs/moe.md: 4-12 s a step here): one family runs on XLA, in launches of its
    # own (xla: "alone").
    "mixtral": {"build": _mixtral, "batches": padded_batches, "wrap": {"policy": "auto"}, "moe": True,
                "fused": True, "xla": "alone"},
    "qwen2moe": {"build": _qwen2moe, "batches": masked_batches, "wrap": {"policy": "auto"},
                 "moe": True, "fused": True, "xla": False},
}


def spec_for(model_name: str, backend: str, backend_spec: dict) -> dict:
    """The backend's spec with what the model needs (its wrap policy, per-backend overrides)."""
    entry = ZOO[model_name]
    override = entry.get("overrides", {}).get(backend, {})
    merged = {**backend_spec, "wrap": entry["wrap"], **override}
    if entry.get("accumulate"):  # the same rows per step, in micro-batches
        merged["micro_batch_size"] = backend_spec["micro_batch_size"] // entry["accumulate"]
        merged["grad_accum_steps"] = entry["accumulate"]
    if "xla" in override:
        merged["xla"] = {**backend_spec.get("xla", {}), **override["xla"]}
    return merged


def optimizer_for(name: str, model):
    """What a user passes to prepare: (class, kwargs), or for `groups` a factory over groups built
    before prepare (it ignores the parameters it is handed, as user code usually does)."""
    if ZOO[name].get("factory"):
        return ZOO[name]["factory"]
    if ZOO[name].get("groups"):
        groups = usual_groups(model, LR)
        return lambda params: torch.optim.AdamW(groups, lr=LR, weight_decay=0.1)
    return torch.optim.AdamW, {"lr": LR, "weight_decay": 0.1}


def loss_of(name: str, model, batch):
    fn = ZOO[name].get("loss_fn")
    return fn(model, batch) if fn else model(**batch).loss


def slice_rows(batch, start: int, stop: int):
    if isinstance(batch, dict):
        return {k: v[start:stop] for k, v in batch.items()}
    return tuple(v[start:stop] for v in batch)


def reference(name: str, seed: int, batches) -> list[float]:
    """One process, the whole global batch, plain PyTorch."""
    torch.manual_seed(seed)
    model = ZOO[name]["build"]()
    opt = optimizer_for(name, model)
    opt = opt(model.parameters()) if callable(opt) else opt[0](
        [p for p in model.parameters() if p.requires_grad], **opt[1])
    losses = []
    for batch in batches:
        loss = loss_of(name, model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
