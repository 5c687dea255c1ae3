"""save_pretrained without a staging copy or an exchange: each rank writes its pieces of the model
straight into their places in the safetensors files.

The pieces are what DCP would write of the backend's portable state (portable.save_state through a
`CaptureSink`, capture.py): `Capture` is a DCP storage writer that keeps each write item's tensor
instead of writing it. So every backend's layout (DTensor shards, ZeRO and XLA flat ranges, tensor-parallel
blocks) arrives the one way, and DCP's own plan says which rank writes what: a tensor held whole by
several ranks is written by one, every chunk exactly once.

Files are planned as transformers' save_pretrained plans them (hf_files.shard_files: cut where a
file would pass `max_bytes`, 5 GB by default), whatever the number of ranks. The layout of every
file (header, where each tensor starts) follows from the shapes alone, so every rank knows where
each of its pieces goes without being told: file i's rank (i mod N) makes it at its full length,
and after one barrier every rank writes each contiguous run of its pieces at its place
(`os.pwrite`, cast to the file's dtype in segments of SEGMENT_BYTES; a row block of a row-major
tensor is one run). Nothing travels between ranks but one all_reduce of how many elements each rank
wrote of each tensor (O(tensors)), checked against the shapes before any file is renamed into
place; it also counts the ranks whose writes failed (a full disk), so every rank raises and none
waits in a collective a failed rank never reaches. A rank writes O(model / N) and holds O(segment).

This needs every rank to see the output directory as one file system, which a checkpoint already
needs (rank 0 renames the directory every rank wrote into). Its predecessor sent each writer its
file's pieces over the process group (an all_to_all per 64 MiB slice): the exchange was half of an
FSDP2 save's time at 2 ranks (docs/bench.md).
"""

from __future__ import annotations

import itertools
import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.checkpoint.format.directory import partial_path
from parallel.checkpoint.hf.capture import Capture
from parallel.checkpoint.hf.hf_files import (
    SafetensorsFile,
    safetensors_layout,
    shard_files,
)
from parallel.checkpoint.state.state_files import Writeback

SEGMENT_BYTES = 16 << 20  # a piece is cast (or copied off the device) and written this much at a time
HINT_BYTES = 1 << 20  # a write of this much or more is handed to the disk's writeback at once
PAGE = 4096


def write_gathered(capture: Capture, names: dict[str, str], dtype: torch.dtype, out: Path,
                   max_bytes: int | None, rank: int, world: int, device: torch.device,
                   durable: bool = False, single: str | None = None, group=None
                   ) -> list[tuple[str, list]]:
    """This rank's pieces of the Hugging Face save written in place (collective). `capture` holds
    this rank's pieces of the "model" section; `names`: each stored tensor written (its key without
    "model.") -> its name in the files; `single`: one file of that name (a PEFT adapter), else
    save_pretrained's plan of files of at most `max_bytes`. `durable`: every rank's writes are
    fsynced before any file is renamed into place. `group`: where the few collectives run (None:
    the default group). Returns the files (name, shard), for the index."""
    shapes = capture.shapes
    entries = [(names[k[len("model."):]], shape, None) for k, shape in shapes.items()
               if k.startswith("model.") and k[len("model."):] in names]
    # save_pretrained's own plan (files of at most max_bytes, 5 GB by default), whatever N: every
    # rank writes into every file its pieces fall in, so N files would be N opens per rank
    files = [(single, entries)] if single else shard_files(entries, dtype.itemsize, max_bytes, 1)
    specs = [[(n, tuple(s), dtype) for n, s, _ in sorted(shard)] for _, shard in files]
    places = [safetensors_layout(spec)[1] for spec in specs]  # name -> its first byte in the file
    out.mkdir(parents=True, exist_ok=True)
    ours: list[SafetensorsFile] = []  # the files this rank makes (i = rank, rank + N, ...)
    writer = InPlace([partial_path(out / name) for name, _ in files], durable)
    try:
        # every file is there, at its length, before any rank writes into it
        mine = [(files[i][0], specs[i]) for i in range(rank, len(files), world)]
        _agree(_attempt(lambda: _make(ours, out, mine)), world, device, group)
        pieces = _in_file_order(capture.pieces, files, names, rank)
        _agree(_attempt(lambda: writer.write_all(pieces, places, shapes, dtype)), world, device,
               group, writer.counts, entries)
        for file in ours:
            file.close(durable)
    except BaseException:
        for file in ours:
            file.abandon()
        raise
    return files


def shared_shapes(capture: Capture, world: int, group=None) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's global shape, as the coordinator's plan saw them, on every rank."""
    shapes = [capture.shapes]
    if world > 1:
        dist.broadcast_object_list(shapes, group_src=0, group=group)
    capture.shapes = shapes[0]
    return capture.shapes


def _make(ours: list, out: Path, files: list) -> None:
    """Each of `files` (name, layout) made at its full length (its header written), added to `ours`
    as it is."""
    for name, spec in files:
        ours.append(SafetensorsFile(out / name, spec))
        ours[-1].allocate()


def _attempt(work) -> BaseException | None:
    """What `work()` raised, kept for _agree (a rank that raised at once would leave the others
    waiting in the collective)."""
    try:
        work()
    except Exception as err:  # noqa: BLE001 - raised by _agree on this rank, after the others hear
        return err
    return None


def _in_file_order(pieces: list, files: list, names: dict[str, str], rank: int):
    """(file, name in it, stored key, offsets, sizes, tensor) of each piece written, by file and
    place; rank r starts at file r, so the ranks write into different files at a time (a file
    system may take one writer of a file at a time: ext4's and XFS's buffered writes hold the file's
    lock)."""
    where = {name: i for i, (_, shard) in enumerate(files) for name, _, _ in shard}
    placed = [(where[names[key[len("model."):]]], names[key[len("model."):]], key, offsets, sizes,
               data) for key, offsets, sizes, data in pieces
              if key.startswith("model.") and names.get(key[len("model."):]) in where]
    count = max(len(files), 1)
    return sorted(placed, key=lambda p: ((p[0] - rank) % count, p[1], p[3]))


def runs(shape: tuple, offsets: tuple, sizes: tuple) -> list[tuple[int, int]]:
    """The contiguous runs of block (offsets, sizes) of a row-major `shape`, in the block's own
    row-major order: (first element's index in the tensor, elements). A block whose dimensions after
    the first are whole (a row block, an FSDP2 or ZeRO piece) is one run; a column block (a
    tensor-parallel split) one run per row."""
    if not shape:
        return [(0, 1)]
    if 0 in sizes:
        return []
    k = len(shape) - 1  # the first dimension from which on the block is whole, but for its own
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    length = sizes[k] * strides[k]
    return [(sum(i * s for i, s in zip(index, strides)) + offsets[k] * strides[k], length)
            for index in itertools.product(*(range(o, o + n) for o, n in zip(offsets[:k], sizes[:k])))]


class InPlace:
    """This rank's writes into the files of one save: each file opened once (one some rank made:
    never created here, no link followed); each piece cast to the file's dtype and copied to host
    memory a segment at a time while a thread writes the segment before (two held); each write's
    pages handed to the disk when `durable`, and every file fsynced at the end. `counts`: the
    elements written of each tensor."""

    def __init__(self, paths: list[Path], durable: bool):
        self.paths, self.durable = paths, durable
        self.fds: dict[int, int] = {}
        self.counts: dict[str, int] = {}
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="polyshard-hf-write")
        self.pending: deque = deque()
        self.writeback = Writeback()

    def __enter__(self) -> InPlace:
        return self

    def write(self, i: int, name: str, place: int, spans: list[tuple[int, int]],
              data: torch.Tensor, dtype: torch.dtype) -> None:
        """Piece `data` of tensor `name`, whose bytes start at `place` in file i: its elements, in
        row-major order, are the tensor's `spans` (runs())."""
        flat, fd, size = data.detach().reshape(-1), self._open(i), dtype.itemsize
        segment = max(1, SEGMENT_BYTES // max(size, data.element_size()))
        start, batch, filled = 0, [], 0  # the segment being gathered: (file offset, elements)
        for at, n in spans:
            while n:
                step = min(n, segment - filled)
                batch.append((place + at * size, step))
                at, n, filled = at + step, n - step, filled + step
                if filled == segment:
                    self._submit(fd, flat[start:start + filled], batch, dtype)
                    start, batch, filled = start + filled, [], 0
        if batch:
            self._submit(fd, flat[start:start + filled], batch, dtype)
        self.counts[name] = self.counts.get(name, 0) + flat.numel()

    def write_all(self, pieces: list, places: list, shapes: dict, dtype: torch.dtype) -> None:
        """Every piece (_in_file_order) at its place; the writes done and synced at the end."""
        with self:
            for i, name, key, offsets, sizes, data in pieces:
                self.write(i, name, places[i][name], runs(shapes[key], offsets, sizes), data, dtype)

    def _submit(self, fd: int, part: torch.Tensor, batch: list, dtype: torch.dtype) -> None:
        host = part.to("cpu", dtype).contiguous()  # no copy for a host piece of the file's dtype
        while len(self.pending) >= 2:  # two segments held: one written, one being made
            self.pending.popleft().result()
        self.pending.append(self.thread.submit(self._pwrite, fd, host, batch))

    def _pwrite(self, fd: int, host: torch.Tensor, batch: list) -> None:
        view, at = memoryview(host.view(torch.uint8).numpy()), 0
        for offset, n in batch:
            nbytes = n * host.element_size()
            chunk, done = view[at:at + nbytes], 0
            while done < nbytes:  # pwrite may write less than asked
                done += os.pwrite(fd, chunk[done:], offset + done)
            if self.durable and nbytes >= HINT_BYTES:  # its whole pages: a neighbour's may be unwritten
                self.writeback.send_range(fd, -(-offset // PAGE) * PAGE, (offset + nbytes) // PAGE * PAGE)
            at += nbytes

    def _open(self, i: int) -> int:
        if i not in self.fds:
            self.fds[i] = os.open(self.paths[i], os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        return self.fds[i]

    def __exit__(self, kind, *exc) -> None:
        """Every write done (or, after a failure, the ones in flight ended) and, when `durable`
        and nothing failed, every file this rank wrote into fsynced; the files closed."""
        try:
            if kind is None:
                while self.pending:
                    self.pending.popleft().result()
                if self.durable:
                    for fd in self.fds.values():
                        os.fsync(fd)
        finally:
            self.thread.shutdown(wait=True, cancel_futures=True)
            for fd in self.fds.values():
                os.close(fd)


def _agree(failed: BaseException | None, world: int, device: torch.device, group=None,
           counts: dict[str, int] | None = None, entries: list = ()) -> None:
    """One all_reduce (collective: every rank raises alike, none is left waiting): how many ranks
    failed, and with `counts` the elements every rank wrote of each tensor, summed, which must equal
    its size (DCP's plan covers each tensor exactly once; a shortfall would leave a hole of zeros
    in the file, an overlap a tensor written twice). O(tensors)."""
    got = torch.tensor([failed is not None, *[(counts or {}).get(name, 0) for name, _, _ in entries]],
                       dtype=torch.int64, device=device)
    if world > 1:
        dist.all_reduce(got, group=group)
    got = got.tolist()
    if failed is not None:
        raise failed
    if got[0]:
        raise RuntimeError(f"save_pretrained: {got[0]} of {world} ranks failed to write their pieces "
                           "(their own errors say why); nothing is renamed into place")
    for (name, shape, _), n in zip(entries, got[1:]):
        if n != math.prod(shape):
            raise RuntimeError(f"save_pretrained: {name} got {n} of its {math.prod(shape)} "
                               "elements from the ranks' pieces")
