"""`checkpoint.async_save`: `save` returns once this rank's state is copied into host memory; a
background writer writes, hashes and publishes it (docs/checkpoint-format.md, "Async save").

Every write path goes through `portable.save_state` with the save's `Sink` (sink.py); a staged sink
copies the state it is given (DTensor shards, ZeRO ranges, whole tensors: only what this rank holds,
O(model / N)) into this rank's `HostPool` and queues the write instead of doing it. The writer runs
the queued DCP writes and the checkpoint's collective steps (hash, barrier, manifest, rename,
`latest`) as one `directory.PendingSave`, over a process group of its own (gloo), so they never
interleave with the training loop's collectives. `checkpoint.async_writer` says where it runs: a process of
this rank's own (writer.py: no share of the training process's interpreter lock) or a thread.
`latest` moves only after every rank's files are durable: a crash while writing leaves it on the
previous complete checkpoint. The next `save`, `load` and `close` wait for the write in flight and
raise its error, if any.
"""

from __future__ import annotations

import copy
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from parallel.checkpoint.chunks import FlatRange, Shards

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
        self.geometry: dict = {}  # DTensor pieces' chunks by layout (chunks.Shards.sources)
        self.later: list[tuple] = []  # (host view, source): copies `complete` makes
        self.landed: list = []  # CUDA events of the copies issued
        self.held: list[torch.Tensor] = []  # their sources, alive until the events complete

    def copies(self, tensors: list[torch.Tensor], now=lambda t: True) -> list[torch.Tensor]:
        """Host copies of `tensors` in the save's next segment, each an exact view (its storage
        is its own bytes, so DCP writes it without cloning: chunks.exact_view). Those `now` does
        not name are only placed: `finish` and `complete` copy them, while training goes on."""
        sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors]
        i, self.used = self.used, self.used + 1
        if i == len(self.segments):
            self.segments.append(None)
            self.fds.append(None)
        if self.segments[i] is None or self.segments[i].nbytes() != sum(sizes):
            self._allocate(i, sum(sizes), any(t.is_cuda for t in tensors))
        segment, out, at = self.segments[i], [], 0
        for t, size in zip(tensors, sizes):
            view = torch.empty(0, dtype=t.dtype).set_(segment[at:at + t.numel() * t.element_size()],
                                                      0, t.shape)
            if now(t):
                view.copy_(t.detach(), non_blocking=t.is_cuda)
                self.copied |= t.is_cuda
            else:
                self.later.append((view, t.detach()))
            out.append(view)
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
        self.segments[i], self.fds[i] = None, None
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
        del self.segments[self.used:], self.fds[self.used:]
        self.used, self.copied = 0, False

    def complete(self) -> None:
        """Every copy of the save has landed (the writer may read the segments): the host
        tensors' copies are made here, on the saver's thread (torch's copy releases the
        interpreter lock), and the CUDA ones waited for."""
        with torch.no_grad():
            for view, t in self.later:
                view.copy_(t)
        for event in self.landed:
            event.synchronize()
        self.later, self.landed, self.held = [], [], []

    def release(self) -> None:
        for i in range(len(self.segments)):
            self._free(i)
        self.segments, self.fds, self.geometry = [], [], {}


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
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

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


class BackgroundSaver:
    """One write in flight per engine: on a process of this rank's own (`writer="process"`,
    writer.py) or on one thread, each with a gloo process group of its own."""

    def __init__(self, writer: str = "process", timeout_s: float = 600.0):
        self.writer, self.timeout_s = writer, timeout_s
        self.pinned = HostPool(shared=writer == "process")
        self.group = None
        self._threads: ThreadPoolExecutor | None = None
        self._process = None  # writer.WriterProcess, started at the first async save
        self._pending: Future | None = None
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="polyshard-stage")
        self._landed: Future | None = None  # the save's copies (HostPool.complete)
        self.staging_wait_s = 0.0  # how long `staged` blocked, in all
        self.failed: BaseException | None = None  # a save's copies raised: no async save after

    @property
    def writer_pid(self) -> int | None:
        """The writer process's pid (None before the first async save, or with a thread)."""
        return None if self._process is None else self._process.proc.pid

    def ensure_group(self):
        """The thread writer's gloo group, made on the first async save by every rank in the same
        order (a collective): its saves' collectives run on it, never on the training loop's
        group. None for the writer process, whose writers have a group of their own (a gloo full
        mesh here would cost every rank N sockets for nothing)."""
        if self.writer == "thread" and self.group is None and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")
        return self.group

    def submit(self, job) -> None:
        """`job`: a directory.PendingSave whose state is placed in `self.pinned` (its copies
        finished there on this saver's thread, then written)."""
        if self.failed is not None:  # its segments may never have reached the writer
            raise RuntimeError(f"an earlier async save could not copy its state ({self.failed}); "
                               "save synchronously (async_save=False) or restart the job")
        landed = self._landed = self._stager.submit(self.pinned.complete)
        if self.writer == "process":
            if self._process is None:
                from parallel.checkpoint.writer import WriterProcess

                self._process = WriterProcess.start(job.rank, self.timeout_s)
            self._process.submit(job, self.pinned, landed)
            return
        if self._threads is None:
            self._threads = ThreadPoolExecutor(1, thread_name_prefix="polyshard-save")
        self._pending = self._threads.submit(lambda: (landed.result(), job.run()))

    def staged(self) -> None:
        """Block until the save's copies have landed (the state may change after); raise what
        copying raised."""
        landed, self._landed = self._landed, None
        if landed is not None:
            start = time.perf_counter()
            try:
                landed.result()
            except BaseException as err:
                self.failed = err
                raise
            finally:
                self.staging_wait_s += time.perf_counter() - start

    def wait(self) -> None:
        """Block until the write in flight is published; raise what it raised."""
        self.staged()
        if self._process is not None:
            self._process.wait()
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """The write in flight is published (or raises), then the writer and the buffers go."""
        try:
            self.wait()
        finally:
            process, self._process = self._process, None
            if process is not None:
                process.stop()
            self.pinned.release()
