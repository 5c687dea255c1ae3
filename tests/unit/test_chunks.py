"""A contiguous range of a flattened tensor as rectangular chunks (parallel/checkpoint/state/chunks.py):
the blocks cover exactly the range, in order, with at most 2(d-1)+1 of them; DCP reads a stored
tensor into any range in place."""

import math
import random

import torch

from parallel.checkpoint.state import portable as ps
from parallel.checkpoint.state.chunks import FlatRange, blocks


def covered(shape, blks) -> list[int]:
    flat = torch.arange(math.prod(shape)).view(shape)
    out = []
    for off, size, _ in blks:
        index = tuple(slice(o, o + s) for o, s in zip(off, size))
        out += flat[index].reshape(-1).tolist()
    return out


def test_blocks_cover_exactly_the_range_in_order():
    rng = random.Random(0)
    for _ in range(500):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
        total = math.prod(shape)
        start = rng.randrange(total)
        n = rng.randint(1, total - start)
        blks = blocks(shape, start, n)
        assert covered(shape, blks) == list(range(start, start + n)), (shape, start, n)
        assert len(blks) <= 2 * (len(shape) - 1) + 1, (shape, start, n, blks)
        positions = [at for _, _, at in blks]
        assert positions == sorted(positions) and positions[0] == 0


def test_a_matrix_range_is_a_partial_row_whole_rows_and_a_partial_row():
    assert blocks((4, 5), 3, 14) == [((0, 3), (1, 2), 0), ((1, 0), (2, 5), 2), ((3, 0), (1, 2), 12)]
    assert blocks((4, 5), 0, 20) == [((0, 0), (4, 5), 0)]
    assert blocks((4, 5), 7, 0) == []


def test_dcp_reads_a_stored_tensor_into_any_range_in_place(tmp_path):
    full = torch.randn(7, 6, 3)
    ps.save_state({"model": {"w": FlatRange(full.reshape(-1).clone(), 0, full.shape)}}, tmp_path,
                  collective=False)
    flat = full.reshape(-1)
    for start, n in ((0, 126), (5, 40), (17, 1), (100, 26)):
        storage = torch.zeros(n)
        ps.load_state({"model": {"w": FlatRange(storage, start, full.shape)}}, tmp_path,
                      collective=False)
        assert torch.equal(storage, flat[start:start + n]), (start, n)
    assert torch.equal(ps.read_model(tmp_path)["w"], full)
