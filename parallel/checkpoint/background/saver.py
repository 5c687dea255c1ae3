"""`checkpoint.async_save`: `save` returns once this rank's state is copied into host memory; a
background writer writes, hashes and publishes it (docs/checkpoint-format.md, "Async save").

Every write path goes through `portable.save_state` with the save's `Sink` (sink.py); a staged sink
copies the state it is given into this rank's `HostPool` (staging.py) and queues the write instead
of doing it. The writer runs
the queued DCP writes and the checkpoint's collective steps (hash, barrier, manifest, rename,
`latest`) as one `directory.PendingSave`, over a process group of its own (gloo), so they never
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

from parallel.checkpoint.background.staging import HostPool


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
