"""Where each rank's elements of a DTensor matrix sit in the whole one (muon.py's `Layout`), read off
its mesh and placements as DTensor itself splits: left to right over the mesh dimensions, `Shard`
as `torch.chunk`, `_StridedShard` (FSDP2 over TP) as its own `_split_tensor`. Each tensor dimension
is split as a vector of positions (O(rows + cols), never the matrix), kept as a slice where it is a
run. The group: the mesh dimensions that shard it (flattened where there are several, as the engine
flattens its data-parallel group); a `Replicate` dimension (HSDP's replicas) gives each replica its
own group, which orthogonalizes the same matrices (as HSDP's replicas do the same step)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.engine.model.optim.muon import Layout, Piece


def _shards(placement) -> bool:
    """A placement that splits a dimension: Shard, or _StridedShard (torch 2.15's is no Shard, and
    its `is_shard()` is False)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() or isinstance(placement, _StridedShard)


def dtensor_layout(p) -> Layout | None:
    """`p` a 2-D DTensor: its Layout, or None where every rank holds it whole."""
    mesh, placements = p.device_mesh, p.placements
    sharding = [i for i, pl in enumerate(placements) if _shards(pl)]
    if not sharding:
        return None
    group = _group(mesh, sharding)
    coords = _coordinates(mesh, dist.get_process_group_ranks(group))
    pieces = [_piece(tuple(p.shape), mesh, placements, c) for c in coords]
    me = dist.get_rank(group)
    local = p.to_local().shape
    mine = pieces[me]
    if mine.numel != local.numel():
        raise RuntimeError(f"Muon: a {tuple(p.shape)} matrix on placements {placements} holds "
                           f"{local.numel()} elements here but its layout says {mine.numel}")
    return Layout(tuple(p.shape), group, pieces, me)


def _group(mesh, dims: list[int]):
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    names = tuple(mesh.mesh_dim_names[i] for i in dims)
    return mesh[names]._flatten("_".join(names)).get_group()


def _coordinates(mesh, ranks: list[int]) -> list[list[int]]:
    """Each rank's coordinate on the mesh, in the group's rank order."""
    return [(mesh.mesh == r).nonzero()[0].tolist() for r in ranks]


def _piece(shape: tuple[int, int], mesh, placements, coordinate: list[int]) -> Piece:
    positions = [torch.arange(n) for n in shape]
    for i, pl in enumerate(placements):
        if _shards(pl):
            along = _along_first(pl)
            chunks, _ = along._split_tensor(positions[pl.dim], mesh.size(i), with_padding=False,
                                            contiguous=False)
            positions[pl.dim] = chunks[coordinate[i]]
    rows, cols = (_as_run(v) for v in positions)
    numel = len(positions[0]) * len(positions[1])
    if isinstance(cols, slice) and cols == slice(0, shape[1]) and isinstance(rows, slice):
        return Piece(flat=slice(rows.start * shape[1], rows.stop * shape[1]), numel=numel)
    return Piece(rows=rows, cols=cols, numel=numel)


def _along_first(placement):
    """The placement, splitting dimension 0 (the one vector it is applied to)."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor)
    return Shard(0)


def _as_run(v: torch.Tensor) -> slice | torch.Tensor:
    if len(v) == 0:
        return slice(0, 0)
    if int(v[-1]) - int(v[0]) + 1 == len(v) and bool((v.diff() == 1).all()):
        return slice(int(v[0]), int(v[-1]) + 1)
    return v


def flat_run(offset: int, numel: int, start: int, stop: int) -> Piece:
    """A matrix laid out flat at [offset, offset + numel) of a buffer cut into [start, stop) per
    rank (FSDP1's flat parameters, ZeRO's flat groups): the part that rank holds, as a run of the
    matrix's flattened elements."""
    lo, hi = max(offset, start), min(offset + numel, stop)
    if hi <= lo:
        return Piece(flat=slice(0, 0), numel=0)
    return Piece(flat=slice(lo - offset, hi - offset), numel=hi - lo)
