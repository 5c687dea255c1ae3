"""FSDP2's shard units at the model's edges, laid out as torchtitan lays them out
(torchtitan/distributed/fsdp.py, apply_fsdp_to_decoder):

- the input embedding is a unit of its own, resharded after forward like the blocks (it is needed
  again only for its weight gradient, and holding it all step costs its whole size);
- the final norm and the output layer are one unit that is *not* resharded after forward: backward
  needs them first, right after forward ends, so resharding would only gather them again at once;
- tied input and output embeddings (one parameter) are one unit with the norm, not resharded;
- the root is sharded without an explicit `reshard_after_forward` (torch then keeps it unsharded):
  what is left in it is small (rotary buffers, a stray bias).

Before this, polyshard's root held embeddings, norm and output layer and was resharded after forward:
one more all-gather of all of them per step, exposed at the start of backward (6 all-gathers against
5 on a 2-layer Llama; for Llama-3-8B 1.05B of 8.03B parameters gathered twice). Why the order of the
`fully_shard` calls matters: units are sharded children first, each owning only what no unit below it
owns, and the root last (it takes whatever is left).
"""

from __future__ import annotations

from torch import nn

FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f")


def edge_units(model: nn.Module, units: list[tuple[str, nn.Module]]) -> list[tuple[list[nn.Module], bool]]:
    """[(modules of one unit, resharded after forward as the blocks are?)] for a Hugging Face model's
    input embedding and [final norm, output layer]; [] for a model without them. Modules already
    inside a wrap unit are left to it."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if not callable(get_in):
        return []
    embed, head = get_in(), get_out() if callable(get_out) else None
    inside = {id(m) for _, unit in units for m in unit.modules()}
    norm = _final_norm(model)
    free = lambda m: m is not None and id(m) not in inside  # noqa: E731 - a filter
    tied = head is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0)
    if tied:
        group = [m for m in (embed, norm, head) if free(m)]
        return [(group, False)] if embed in group and head in group else []
    out = [([embed], True)] if free(embed) else []
    tail = [m for m in (norm, head) if free(m)]
    if head is not None and head in tail:
        out.append((tail, False))
    return out


def _final_norm(model: nn.Module) -> nn.Module | None:
    """The norm before the output layer: a direct child of the base model named as HF names it."""
    from parallel.engine.objective import base_model

    base = getattr(base_model(model), "base_model", model)  # under a PEFT wrapper too
    base = base if isinstance(base, nn.Module) else model
    for name in FINAL_NORMS:
        found = getattr(base, name, None)
        if isinstance(found, nn.Module):
            return found
    return None
