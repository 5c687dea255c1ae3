"""`polyshard ckpt import deepspeed`, streamed: one rank's optimizer file in memory at a time.

DeepSpeed's zero_to_fp32 loads every rank's optimizer file and concatenates the partitions into the
whole model (and each Adam moment): host memory of the whole state, twice over while merging. Here
each source rank's file becomes one writer's part of the portable state (checkpoint/streamed.py):
its fp32 partition and moments as FlatRange blocks of the whole tensors, at the offsets DeepSpeed's
own merge reads them from (ZeRO-3: each parameter split in ceil(numel / world) pieces, one per rank;
ZeRO-1/2: each parameter group one flat vector cut in equal partitions, with DeepSpeed's alignment
paddings). Frozen parameters (no fp32 master, no optimizer state) come from the model-states
files as DeepSpeed's zero_to_fp32 merges them: ZeRO-3 each rank's slice of ceil(numel / world)
elements from its own file, ZeRO-1/2 whole from rank 0's.
"""

from __future__ import annotations

import math
import torch

from parallel.checkpoint.state.chunks import FlatRange
from parallel.checkpoint.importers import named_groups
from parallel.checkpoint.state.optim_state import shared_step
from parallel.checkpoint.state.portable import clean_name
from parallel.checkpoint.state.streamed import Streamed


def streamed_zero(models, optim_files: list, stage: int, world: int, load, frozen) -> Streamed:
    """The portable state of a ZeRO checkpoint as `world` parts (part i from rank i's optimizer
    file, `load(path)` -> its optimizer_state_dict, and the frozen parameters' slices in rank i's
    model-states file, `frozen(i)` -> its frozen_param_fragments)."""
    frozen_shapes = dict(models[0].frozen_param_shapes or {})
    shapes = [dict(g) for g in models[0].param_shapes]  # per (sub-)group, in order
    names = [[clean_name(n) for n in g] for g in shapes]
    per_group = names if stage <= 2 else [[n for g in names for n in g]]

    def part(i: int) -> dict:
        saved = load(optim_files[i])
        flats, raw = checked_partitions(saved, shapes, stage, world, optim_files[i])
        groups = sorted(raw["state"])
        keys = [k for k, v in raw["state"][groups[0]].items() if torch.is_tensor(v) and v.dim() == 1
                and v.numel() > 1]
        place = _zero3_places if stage > 2 else _zero2_places
        model, optim = {}, {}
        for raw_name, shape, g, lo, start, n in place(shapes, flats, i, world,
                                                        saved.get("param_alignment_paddings")):
            name = clean_name(raw_name)
            model[name] = FlatRange(flats[g][lo:lo + n], start, tuple(shape))
            optim[name] = {k: FlatRange(raw["state"][groups[g]][k][lo:lo + n], start, tuple(shape))
                           for k in keys}
        model.update(_frozen_part(frozen, frozen_shapes, stage, i, world))
        for alias, canonical in models[0].shared_params:
            if clean_name(canonical) in model:
                model[clean_name(alias)] = model[clean_name(canonical)]
        if i:
            return {"model": model, "optim": {"state": optim}}
        model.update({clean_name(k): v for k, v in models[0].buffers.items()})
        step = shared_step(raw["state"].values())
        if step is not None:
            for name in (n for g in names for n in g):
                optim.setdefault(name, {})["step"] = step
        return {"model": model, "optim": {"state": optim, "param_groups": named_groups(
            raw["param_groups"], per_group)}}

    return Streamed(part, world)


def checked_partitions(saved: dict, shapes: list[dict], stage: int, world: int, path):
    """(fp32 partitions, base optimizer state) of one rank's optimizer file, refused naming it
    where they cannot be what param_shapes says (#65: an empty state was a traceback, partitions
    shorter than their parameters imported with exit 0): a flat fp32 tensor per group, an optimizer
    state with entries, and partitions that cover every parameter (ZeRO-1/2: the group's
    parameters and DeepSpeed's alignment paddings over world equal partitions; ZeRO-3: each
    parameter's ceil(numel / world) piece)."""
    from parallel.checkpoint.importers import CheckpointImportError

    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    flats = saved.get(key)
    raw = saved.get("base_optimizer_state", saved.get("optimizer_state_dict"))
    if not (isinstance(flats, list) and flats and all(torch.is_tensor(f) and f.dim() == 1
                                                     for f in flats)):
        raise CheckpointImportError(f"{path}: no fp32 partitions ({key}); not a ZeRO-{stage} "
                                    "optimizer file, or a damaged one")
    if not (isinstance(raw, dict) and isinstance(raw.get("state"), dict) and raw["state"]):
        raise CheckpointImportError(f"{path}: holds no optimizer state (no step was taken, or it "
                                    "is damaged); import a checkpoint saved after a step")
    if stage <= 2:
        paddings = saved.get("param_alignment_paddings") or []
        needs = [sum(math.prod(s) for s in group.values())
                 + sum(paddings[g] if g < len(paddings) else []) for g, group in enumerate(shapes)]
        haves = [world * f.numel() for f in flats]
    else:
        needs = [sum(math.ceil(math.prod(s) / world) for g in shapes for s in g.values())]
        haves = [sum(f.numel() for f in flats)]
    for g, need in enumerate(needs):
        have = haves[g] if g < len(haves) else 0
        if need > have:
            raise CheckpointImportError(f"{path}: group {g}'s partitions hold {have:,} values over "
                                        f"{world} rank(s), and its parameters (param_shapes) need "
                                        f"{need:,}; the checkpoint is damaged or crafted")
    return flats, raw


def _frozen_part(frozen, shapes: dict, stage: int, rank: int, world: int) -> dict:
    """Rank `rank`'s part of the frozen parameters: ZeRO-3's slice [rank * piece, + piece) of each
    (piece = ceil(numel / world), the last padded), ZeRO-1/2's whole tensors in part 0."""
    if not shapes or (stage <= 2 and rank):
        return {}
    fragments, out = frozen(rank), {}
    for raw_name, shape in shapes.items():
        if stage <= 2:
            out[clean_name(raw_name)] = fragments[raw_name]
            continue
        numel = math.prod(shape)
        piece = math.ceil(numel / world)
        n = max(0, min(piece, numel - rank * piece))
        if n:
            out[clean_name(raw_name)] = FlatRange(fragments[raw_name].reshape(-1)[:n],
                                                  rank * piece, tuple(shape))
    return out


def _zero3_places(shapes, flats, rank: int, world: int, _paddings):
    """(name, shape, group, offset in the group's flat tensor, start in the whole, count) of what
    rank `rank` holds: DeepSpeed's GatheredTensor reads the same places."""
    ends = [int(x) for x in torch.tensor([f.numel() for f in flats]).cumsum(0)]
    offset = 0
    for group in shapes:
        for name, shape in group.items():
            numel = math.prod(shape)
            piece = math.ceil(numel / world)
            g = next(j for j, end in enumerate(ends) if offset < end)
            lo = offset - (ends[g - 1] if g else 0)
            if offset + piece > ends[g]:
                raise ValueError(f"{name}: its partition spans two flat groups")
            n = max(0, min(piece, numel - rank * piece))
            if n:
                yield name, shape, g, lo, rank * piece, n
            offset += piece


def _zero2_places(shapes, flats, rank: int, world: int, paddings):  # noqa: ARG001 - one signature
    """The same for ZeRO-1/2: group g's params lie one after the other (plus DeepSpeed's alignment
    paddings) in a flat vector of which rank `rank` holds [rank * P, (rank + 1) * P)."""
    for g, group in enumerate(shapes):
        size = flats[g].numel()
        first, last = rank * size, (rank + 1) * size
        offset = 0
        for j, (name, shape) in enumerate(group.items()):
            numel = math.prod(shape)
            lo, hi = max(offset, first), min(offset + numel, last)
            if hi > lo:
                yield name, shape, g, lo - first, lo - offset, hi - lo
            offset += numel + (paddings[g][j] if paddings is not None else 0)
