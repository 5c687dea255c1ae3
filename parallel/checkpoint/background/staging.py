"""Staging for `checkpoint.async_save` (saver.py): a copy of this rank's state in host memory
that no later step can change, made into a `HostPool` kept from one save to the next. `stage` finds
the tensors (DTensor shards, ZeRO and FSDP1 ranges, whole tensors: only what this rank holds,
O(model / N)) and places each in the pool; buffers are copied at once, the rest while the next
forward and backward run (`HostPool.complete`), before the next optimizer step changes them. A
staged state crosses to the writer process pickled by reference into the pool (`PoolPickler`)."""

from __future__ import annotations

import copy
import copyreg
import os
import pickle

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from parallel.checkpoint.state.chunks import FlatRange, Shards

ALIGN = 64  # bytes: every staged tensor starts on a cache line (and any dtype's alignment)


class HostPool:
    """The host memory staged copies go into, kept from one async save to the next: segments of
    bytes, one per state a save queues, each reused while the next save's state has the same
    bytes (a new shape: a new segment). Copies from CUDA go into page-locked segments without
    blocking the host (into pageable memory the copy was the whole blocking time: measured 0.78 s
    against 0.11 s pinned on an H100, docs/checkpoint-format.md); from CPU tensors, a plain copy
    with no allocation. `shared`: segments are memory files (memfd) another process maps too (the
    writer process: nothing is copied again to hand it over). As large as this rank's state,
    O(model / N), held between saves until `release` (torchtitan's async_with_pinned_mem holds the
    same); a save reuses them only after the previous write has finished (one write in flight)."""

    def __init__(self, shared: bool = False):
        self.shared = shared
        self.segments: list[torch.UntypedStorage] = []
        self.fds: list[int | None] = []  # each shared segment's memory file
        self.fresh: set[int] = set()  # segments (re)made since the writer last saw them
        self.dropped: set[int] = set()  # segments freed since: the writer unmaps them
        self.registered: set[int] = set()  # shared segments page-locked with cudaHostRegister
        self.used = 0
        self.copied = False  # a device-to-host copy is in flight
        self.geometry: dict = {}  # DTensor pieces' chunks by layout and by id (Shards.sources)
        self.views: list[tuple | None] = []  # each segment's (dtypes and shapes, views), reused
        self.later: list[tuple] = []  # (host view, source): copies `complete` makes
        self.landed: list = []  # CUDA events of the copies issued
        self.held: list[torch.Tensor] = []  # their sources, alive until the events complete

    def copies(self, tensors: list[torch.Tensor], now=lambda t: True) -> list[torch.Tensor]:
        """Host copies of `tensors` in the save's next segment, each an exact view (its storage
        is its own bytes, so DCP writes it without cloning: chunks.exact_view). Those `now` does
        not name are only placed: `finish` and `complete` copy them, while training goes on."""
        i, self.used = self.used, self.used + 1
        if i == len(self.segments):
            self.segments.append(None)
            self.fds.append(None)
            self.views.append(None)
        layout = [(t.dtype, t.shape) for t in tensors]
        if self.views[i] is None or self.views[i][0] != layout:  # else the last save's views
            self.views[i] = (layout, self._place(i, tensors))
        for view, t in zip(self.views[i][1], tensors):
            if now(t):
                view.copy_(t.detach(), non_blocking=t.is_cuda)
                self.copied |= t.is_cuda
            else:
                self.later.append((view, t.detach()))
        return list(self.views[i][1])

    def _place(self, i: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views of segment `i` (made anew unless it has the bytes) for `tensors`, in order."""
        sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors]
        if self.segments[i] is None or self.segments[i].nbytes() != sum(sizes):
            self._allocate(i, sum(sizes), any(t.is_cuda for t in tensors))
        segment, out, at = self.segments[i], [], 0
        for t, size in zip(tensors, sizes):
            out.append(torch.empty(0, dtype=t.dtype).set_(
                segment[at:at + t.numel() * t.element_size()], 0, t.shape))
            at += size
        return out

    def _allocate(self, i: int, nbytes: int, pinned: bool) -> None:
        self._free(i)
        if self.shared and nbytes:
            fd = os.memfd_create(f"polyshard-stage-{i}", os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
            segment = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", True, nbytes)
            if pinned:  # page-locked in place, as torch's own staging (_state_dict_stager) does
                _register(segment.data_ptr(), nbytes)
                self.registered.add(i)
            self.fds[i] = fd
            self.fresh.add(i)
        else:
            segment = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        self.segments[i] = segment

    def _free(self, i: int) -> None:
        if i in self.registered:
            _unregister(self.segments[i].data_ptr())
            self.registered.discard(i)
        if self.fds[i] is not None:
            os.close(self.fds[i])
            self.dropped.add(i)
        self.segments[i], self.fds[i], self.views[i] = None, None, None
        self.fresh.discard(i)

    def finish(self) -> None:
        """The save's copies are placed: segments it did not use (the state changed) are freed,
        and on CUDA every copy is issued without waiting for it. The copies made now go on the
        training stream, ordered before the next step's kernels (buffers: the next forward may
        change them); the later ones on a stream of their own, after what the training stream
        has queued, so they overlap the next forward and backward. `complete` waits for them."""
        if self.copied:
            self.landed.append(torch.cuda.current_stream().record_event())
        cuda = [(view, t) for view, t in self.later if t.is_cuda]
        if cuda:
            side = torch.cuda.Stream(device=cuda[0][1].device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for view, t in cuda:
                    view.copy_(t, non_blocking=True)
            self.landed.append(side.record_event())
        # CUDA sources stay referenced until `complete`: a temporary one (a contiguous copy)
        # freed now could be reallocated by the next forward while the side stream reads it
        self.held = [t for _, t in cuda]
        self.later = [(view, t) for view, t in self.later if not t.is_cuda]
        for i in range(self.used, len(self.segments)):
            self._free(i)
        del self.segments[self.used:], self.fds[self.used:], self.views[self.used:]
        self.used, self.copied = 0, False

    def complete(self) -> None:
        """Every copy of the save has landed (the writer may read the segments): the host
        tensors' copies are made here, on the saver's thread, and the CUDA ones waited for. One
        call for all: a copy per call gave the interpreter lock back at each return, and took it
        again only after the training thread's switch interval (5 ms) whenever that thread was
        running Python (500 copies of a 300 MB state: 2.7 s against 0.045 s, measured)."""
        if self.later:
            with torch.no_grad():
                torch._foreach_copy_(*map(list, zip(*self.later)))
        for event in self.landed:
            event.synchronize()
        self.later, self.landed, self.held = [], [], []

    def release(self) -> None:
        for i in range(len(self.segments)):
            self._free(i)
        self.segments, self.fds, self.views, self.geometry = [], [], [], {}


def _register(ptr: int, nbytes: int) -> None:
    """cudaHostRegister (portable), as torch.cuda._pin_memory_utils does where it exists."""
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))
    if err:
        raise RuntimeError(f"page-locking {nbytes} bytes of staging memory failed (cudaError "
                           f"{err}); set checkpoint.async_writer: thread")


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def stage(obj, pool: HostPool | None = None, now: set[int] | None = None):
    """A copy of a state in host memory that no later training step can change: each rank's own
    shards and ranges only, so the copy is as large as what the rank holds. DTensors and sharded
    tensors become `Shards` (their pieces as DCP writes them, with no device mesh behind them), so
    the copy can be written by another thread or process. `now`: the data pointers of what the
    next step's forward may change (the module's buffers), copied at once; the rest (parameters,
    optimizer state: only an optimizer step changes them) is copied by `pool.complete`, which the
    engine waits for before its next optimizer step (Checkpointer.staged). None: all at once."""
    pool = pool or HostPool()  # none: memory of this copy's own
    sources: list[torch.Tensor] = []
    pieces: dict[int, list] = {}  # id of a sharded tensor -> its pieces (looked up once)
    with torch.no_grad():
        _collect(obj, sources, pieces, pool.geometry)
        copies = pool.copies(sources, (lambda t: True) if now is None else
                             (lambda t: t.data_ptr() in now))
    return _rebuild(obj, iter(copies), pieces)


def _sharded(obj) -> bool:
    return isinstance(obj, (DTensor, ShardedTensor))


def _collect(obj, out: list, pieces: dict, geometry: dict) -> None:
    """The tensors `stage` copies, in the order _rebuild takes them back."""
    if isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out, pieces, geometry)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, out, pieces, geometry)
    elif isinstance(obj, FlatRange):
        out.append(obj.data)
    elif isinstance(obj, torch.Tensor) and _sharded(obj):
        pieces[id(obj)] = Shards.sources(obj, geometry)
        out.extend(data for _, _, data in pieces[id(obj)])
    elif isinstance(obj, torch.Tensor):
        out.append(obj)


def _rebuild(obj, copies, pieces: dict):
    if isinstance(obj, dict):
        return {k: _rebuild(v, copies, pieces) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, copies, pieces) for v in obj)
    if isinstance(obj, FlatRange):
        return obj.over(next(copies))
    if id(obj) in pieces:
        return Shards(obj.size(), [(chunk, props, next(copies))
                                   for chunk, props, _ in pieces[id(obj)]])
    if isinstance(obj, torch.Tensor):
        return next(copies)
    return copy.deepcopy(obj)


def _staged(*ref):  # a staged tensor in a pickled save: the writer's unpickler resolves it
    raise RuntimeError("a reference to a rank's staging memory, read outside its writer")


class PoolPickler(pickle.Pickler):
    """Staged tensors by reference: (segment, byte offset, view) in the rank's HostPool. A reducer
    for tensors alone (a dispatch table entry): a persistent_id was a Python call per pickled
    object, 20,000 a save of a 124M model (15 ms on an H200 host)."""

    def __init__(self, file, pool):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.spans = [(s.data_ptr(), s.data_ptr() + s.nbytes(), i)
                      for i, s in enumerate(pool.segments) if pool.fds[i] is not None]
        self.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: self._tensor}

    def _tensor(self, obj: torch.Tensor):
        if not obj.numel():  # a rank's empty range: by value it is torch's legacy save, 64 us each
            return _empty, (obj.dtype, tuple(obj.shape))
        ptr = (storage := obj.untyped_storage()).data_ptr()
        for start, end, i in self.spans:
            if start <= ptr < end:
                return _staged, (i, ptr - start, storage.nbytes(), obj.dtype, tuple(obj.shape),
                                 obj.stride(), obj.storage_offset())
        return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # not staged (an RNG state): by value


def _empty(dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class PoolUnpickler(pickle.Unpickler):
    """The writer's side: each reference a view of its own mapping of the segment."""

    def __init__(self, file, segments: dict):
        super().__init__(file)
        self.segments = segments

    def find_class(self, module: str, name: str):
        if (module, name) == ("parallel.checkpoint.background.staging", "_staged"):
            return self._view
        return super().find_class(module, name)

    def _view(self, i, offset, nbytes, dtype, shape, stride, storage_offset) -> torch.Tensor:
        storage = self.segments[i][offset:offset + nbytes]  # the same memory, exactly its bytes
        return torch.empty(0, dtype=dtype).set_(storage, storage_offset, shape, stride)
