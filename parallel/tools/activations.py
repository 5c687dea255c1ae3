"""The activation model `polyshard plan` counts by (docs/bench.md, "The activation model"): the bytes
an HF decoder (Llama's layout) keeps for backward, tensor by tensor per token, times layers."""

from __future__ import annotations


def activations(cfg: dict | None, micro_batch: int, seq: int, precision: str,
                checkpointing: bool, tp: int = 1, loss_tile: int | None = None,
                offload: bool = False, cp: int = 1) -> float | None:
    """Bytes an HF decoder (Llama's layout) keeps for backward, counted tensor by tensor per token
    (docs/bench.md, "The activation model"), times layers, plus the loss's log-probabilities and
    what is in flight at the peak. Full recomputation: each layer's input, and one layer's whole
    activations while its backward runs. TP without sequence parallelism: norms whole on every
    rank, the rest split over tp. `loss_tile`: one tile's logits. `offload`
    (sequence.offload_activations): the device holds the layer in flight. `cp` (Ulysses): seq / cp
    tokens per rank (padded up); eager's scores over the whole row for a / (tp x cp) heads."""
    if not cfg:
        return None
    h, a, layers, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"], \
        cfg["vocab_size"]
    kv, inner = cfg.get("num_key_value_heads") or a, cfg.get("intermediate_size") or 4 * h
    c = 4 if precision == "fp32" else 2  # bytes of the compute dtype
    tokens = -(-seq // cp) * micro_batch
    eager = (cfg.get("_attn_implementation") or cfg.get("attn_implementation")) == "eager"
    # each RMSNorm keeps its input in fp32 (upcast), the normalised input and its output
    norms = 2 * (12 if c == 4 else 8) * h
    # eager repeats k and v to every head and keeps the fp32 softmax (and its cast) per score;
    # SDPA / flash keep q, k, v and their output, plus the contiguous copy o_proj reads
    attention = (c * 4 * h + a * seq * (4 if c == 4 else 6)) if eager else \
        c * (3 * h + 2 * h * kv / a)
    mlp = 4 * c * inner  # gate (SiLU's input), its output, up, and their product (down's input)
    layer = norms + (attention + mlp) / tp
    kept = (c * h * layers + layer) if checkpointing else layer * layers
    if offload:
        kept = layer
    # the loss keeps its fp32 log-probabilities (the logits are freed with the forward's output)
    tile = min(tokens, loss_tile or tokens)
    # in flight at the peak, one at a time: the loss's backward (the gradients of the
    # log-probabilities and of the logits, fp32), or one layer's (eager's two score-sized
    # gradients, or the MLP's three)
    backward = max(8 * tile * vocab, tokens * max(8 * a * seq if eager else 0, 3 * c * inner) / tp)
    return tokens * kept + 4 * tile * vocab + backward
