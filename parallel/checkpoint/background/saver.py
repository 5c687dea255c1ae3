"""`checkpoint.async_save`: `save` returns once this rank's state is copied into host memory; a
background writer writes, hashes and publishes it (docs/checkpoint-format.md, "Async save").

Every write path goes through `portable.save_state` with the save's sink (state/sink.py); a
`StagedSink` copies the state it is given into this rank's `HostPool` (staging.py) and queues the
write instead of doing it. The writer runs
the queued DCP writes and the checkpoint's collective steps (hash, barrier, manifest, rename,
`latest`) as one `finishing.PendingSave`, over a process group of its own (gloo), so they never
interleave with the training loop's collectives. `checkpoint.async_writer` says where it runs: a process of
this rank's own (writer.py: no share of the training process's interpreter lock) or a thread.
`latest` moves only after every rank's files are durable: a crash while writing leaves it on the
previous complete checkpoint. The next `save`, `load` and `close` wait for the write in flight and
raise its error, if any.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist

from parallel.checkpoint.background.staging import HostPool, stage
from parallel.checkpoint.state.sink import Sink


class StagedSink(Sink):
    """checkpoint.async_save's sink: each state handed to it is copied to host memory now (CUDA
    tensors into `pool`'s pinned buffers) and queued; the background writer writes the queue
    (portable.write_queued), after which the sink writes what it is given as a plain one does.
    `now`: data pointers copied at once (buffers the next forward may change: staging.stage)."""

    def __init__(self, tmp, pool: HostPool | None = None, group=None, threads: int = 1,
                 now: set[int] | None = None):
        super().__init__(tmp, group=group, threads=threads)
        self.pool, self.now = pool, now
        self.queued: list[tuple] = []  # (host copy of a state, planner, collective)
        self.handed = False  # the queue went to the writer: later states are written at once

    def __getstate__(self) -> dict:
        """What a writer process gets: no staging pool (the rank's), no process group."""
        return {**super().__getstate__(), "pool": None, "now": None}

    def defer(self, state: dict, planner, collective: bool) -> bool:
        """A host copy of `state` (this rank's part only: O(model / N)) that no later training step
        can change, written by portable.write_queued."""
        if self.handed:
            return False
        self.queued.append((stage(state, self.pool, self.now), planner, collective))
        return True

    def placed(self, wait: bool = False) -> None:
        """Every copy `defer` placed is made or issued: buffers' at once, the rest completed by
        the pool on the saver's thread (HostPool.complete); `wait`: completed here (a save that
        failed half-way leaves nothing for the next one to copy)."""
        if self.pool is not None:
            self.pool.finish()
            if wait:
                self.pool.complete()

    def take_queued(self) -> list[tuple]:
        queued, self.queued, self.handed = self.queued, [], True
        return queued


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
        """`job`: a finishing.PendingSave whose state is placed in `self.pinned` (its copies
        finished there on this saver's thread, then written)."""
        if self.failed is not None:  # its segments may never have reached the writer
            raise RuntimeError(f"an earlier async save could not copy its state ({self.failed}); "
                               "save synchronously (async_save=False) or restart the job")
        if self.writer == "process":
            from parallel.checkpoint.background.writer import WriterProcess

            self._process = self._process or WriterProcess.start(job.rank, self.timeout_s)
            # pickled before the copies start: on a host whose cores the ranks already hold, the
            # copies would take this thread's core while `save` has not yet returned
            try:
                packed = self._process.pack(job, self.pinned)
            except BaseException:
                self.pinned.complete()  # nothing left for the next save to copy
                raise
        landed = self._landed = self._stager.submit(self.pinned.complete)
        if self.writer == "process":
            return self._process.submit(packed, landed)
        self._threads = self._threads or ThreadPoolExecutor(1, thread_name_prefix="polyshard-save")
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
