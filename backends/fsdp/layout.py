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
        ok = embed in group and head in group and not _aliased_outside(model, group)
        return [(group, False)] if ok else []
    out = [([embed], True)] if free(embed) and not _aliased_outside(model, [embed]) else []
    tail = [m for m in (norm, head) if free(m)]
    if head is not None and head in tail and not _aliased_outside(model, tail):
        out.append((tail, False))
    return out


def _aliased_outside(model: nn.Module, group: list[nn.Module]) -> bool:
    """Does a module outside `group` hold one of its parameters under another name? fully_shard
    replaces a parameter only on the modules below the one it shards, so such an alias would be left
    pointing at the old tensor: the tie broken, a stale copy checkpointed under the other name (BERT's
    `cls.predictions.bias` is `cls.predictions.decoder.bias`; T5's stacks hold `shared`). Such a
    group is left to the root, which holds both names."""
    inside = {id(m) for g in group for m in g.modules()}
    mine = {id(p) for g in group for p in g.parameters()}
    return any(id(p) in mine for m in model.modules() if id(m) not in inside
               for p in m.parameters(recurse=False))


def _final_norm(model: nn.Module) -> nn.Module | None:
    """The norm before the output layer: a direct child of the base model named as HF names it."""
    from parallel.kits.objective import base_model

    base = getattr(base_model(model), "base_model", model)  # under a PEFT wrapper too
    base = base if isinstance(base, nn.Module) else model
    for name in FINAL_NORMS:
        found = getattr(base, name, None)
        if isinstance(found, nn.Module):
            return found
    return None
