"""XLA FSDP v1's shard layout: which original parameters each sharded (maybe flattened) parameter
holds, read from the model's own shard metadata, and the conversions between whole tensors and a
rank's flat shard (how XLA pads them)."""

from __future__ import annotations

import torch
from torch import nn

from parallel.checkpoint.state.portable import clean_name


def v1_layout(model) -> list[tuple[nn.Parameter, list[tuple[str, torch.Size]]]]:
    """Each sharded parameter of an XlaFullyShardedDataParallel model with the original parameters
    it holds, in order: one when parameters are sharded one by one, several when a unit's are
    flattened (flatten_parameters). Read from the model's own shard metadata, as XLA's
    consolidate_sharded_state_dicts reads it."""
    md = model.get_shard_metadata()
    layout = []
    for name, p in model.named_parameters():
        if p.dim() != 1:
            raise RuntimeError("XLA FSDP v1 with shard_param_on_dim_0 has no portable layout; "
                               "leave it unset")
        parts = name.replace("_fpw_module.", "").split(".")
        cut = next(i for i, part in enumerate(parts) if part.startswith("_fsdp_shard"))
        prefix, suffix = ".".join(parts[:cut]), ".".join(parts[cut:])
        info = md["shard_info"][prefix][suffix]
        full = f"{prefix}.{info['_orig_name']}" if prefix else info["_orig_name"]
        if full in md["flatten_info"]:
            names, shapes, _ = md["flatten_info"][full]
            owner = full.rsplit(".", 1)[0]
            members = [(clean_name(f"{owner}.{n}"), torch.Size(s)) for n, s in zip(names, shapes)]
        else:
            members = [(clean_name(full), torch.Size(info["_orig_size"]))]
        layout.append((p, members))
    return layout


def split_members(flat: torch.Tensor, members) -> dict[str, torch.Tensor]:
    """Gathered (padded) flat shards -> each original tensor, by name."""
    out, offset = {}, 0
    for name, shape in members:
        out[name] = flat[offset:offset + shape.numel()].view(shape).clone()
        offset += shape.numel()
    return out


def shard_of(tensors: dict, members, shard_numel: int, rank: int) -> torch.Tensor:
    """The inverse: concatenate the originals, pad as XLA FSDP pads, take this rank's slice."""
    flat = torch.cat([tensors[n].reshape(-1) for n, _ in members])
    end = shard_numel * (rank + 1)
    flat = torch.nn.functional.pad(flat, (0, max(0, end - flat.numel())))
    return flat[shard_numel * rank:end].clone()


def member_ranges(flat: torch.Tensor, members, rank: int) -> dict:
    """This rank's flat shard `flat` (a CPU copy, `shard_numel` elements of the padded concatenation
    of `members`) as each member's contiguous range, in place: {name: FlatRange}. A member this
    shard holds nothing of gets an empty range (its key stays in the state on every rank)."""
    from parallel.checkpoint.state.chunks import FlatRange

    size, out, offset = flat.numel(), {}, 0
    lo, hi = rank * size, (rank + 1) * size
    for name, shape in members:
        a, b = max(offset, lo), min(offset + shape.numel(), hi)
        out[name] = (FlatRange(flat[a - lo:b - lo], a - offset, shape) if b > a
                     else FlatRange(flat[:0], 0, shape))
        offset += shape.numel()
    return out
