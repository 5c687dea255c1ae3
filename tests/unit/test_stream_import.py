"""stream_import's places: each source rank's pieces of each parameter, put back where they say,
rebuild every parameter whole (ZeRO-3: ceil(numel / world) per rank, the last padded; ZeRO-1/2: each
group one flat vector cut in equal partitions, with DeepSpeed's alignment paddings)."""

import math

import torch

from backends.deepspeed.stream_import import _zero2_places, _zero3_places

SHAPES = [{"a": (5, 3), "b": (7,)}, {"c": (2, 2)}]


def rebuild(places, flats_per_rank, world, paddings=None):
    whole = {n: torch.full((math.prod(s),), float("nan")) for g in SHAPES for n, s in g.items()}
    for rank in range(world):
        for name, shape, g, lo, start, n in places(SHAPES, flats_per_rank[rank], rank, world,
                                                   paddings):
            whole[name][start:start + n] = flats_per_rank[rank][g][lo:lo + n]
    return whole


def originals():
    torch.manual_seed(0)
    return {n: torch.randn(math.prod(s)) for g in SHAPES for n, s in g.items()}


def test_zero3_pieces_rebuild_every_parameter():
    values, world = originals(), 3
    flats = []
    for rank in range(world):
        pieces = []
        for g in SHAPES:
            for n in g:
                piece = math.ceil(values[n].numel() / world)
                padded = torch.cat([values[n], torch.zeros(piece * world - values[n].numel())])
                pieces.append(padded[rank * piece:(rank + 1) * piece])
        flats.append([torch.cat(pieces[:2]), pieces[2]])  # two sub-groups, as SHAPES
    whole = rebuild(_zero3_places, flats, world)
    assert all(torch.equal(whole[n], values[n]) for n in values)


def test_zero2_partitions_rebuild_every_parameter_with_paddings():
    values, world = originals(), 2
    paddings = [[1, 0], [0]]  # DeepSpeed's per-parameter alignment padding after a
    flats = [[], []]
    for gi, g in enumerate(SHAPES):
        parts = []
        for j, n in enumerate(g):
            parts += [values[n], torch.zeros(paddings[gi][j])]
        vector = torch.cat(parts)
        size = math.ceil(vector.numel() / world)
        vector = torch.cat([vector, torch.zeros(size * world - vector.numel())])
        for rank in range(world):
            flats[rank].append(vector[rank * size:(rank + 1) * size])
    whole = rebuild(_zero2_places, flats, world, paddings)
    assert all(torch.equal(whole[n], values[n]) for n in values)
