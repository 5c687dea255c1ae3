"""Where one save's files go, passed down explicitly from `save` to every writer.

A `Sink` is one checkpoint being written by one rank: its temporary directory, the files this rank
wrote there (each rank hashes and fsyncs its own: directory.finish_checkpoint), and how state is
written: at once, or (checkpoint.async_save) copied to host memory now and written later by the
background writer, a thread or a process (saver.py; the copies: staging.py). Nothing about
a save in flight lives in a module global, so two saves in flight, or a save on another thread, each
keep their own list and queue.
"""

from __future__ import annotations

from pathlib import Path

import torch


class Sink:
    def __init__(self, tmp: str | Path, staged: bool = False, pool=None, group=None,
                 threads: int = 1, sections: tuple[str, ...] | None = None, durable: bool = True,
                 capture=None):
        """`staged`: state writes are copied to host memory (CUDA tensors into `pool`'s pinned
        buffers) and queued until portable.write_queued. `group`: the process group DCP's collective
        writes run over (the background saver's own, so they never meet the training loop's).
        `threads`: checkpoint.write_threads. `sections`: the portable state's top-level keys this
        save keeps ("model" alone for save_pretrained's staging: no optimizer state written);
        None keeps all. `durable`: state files are fsynced (a checkpoint); False for a staging
        copy read back at once and removed (its pages need never reach the disk). `capture`: a
        hf_gather.Capture that DCP hands each write item to instead of a file (save_pretrained:
        each rank writes its pieces into the safetensors files, nothing is written here)."""
        self.tmp = Path(tmp)
        self.staged = staged
        self.pool = pool
        self.group = group
        self.written: list[Path] = []  # files this rank wrote under tmp, hashed by this rank
        # {file: {size, digest}} of files hashed as they were written (portable.py's DCP writer):
        # finish_checkpoint reads back only the others
        self.described: dict[Path, dict] = {}
        self.queued: list[tuple] = []  # while staged: (host copy of a state, planner, collective)
        self.threads = threads  # DCP's writer threads for this rank's state files
        self.sections = sections
        self.durable = durable
        self.capture = capture
        self.now: set[int] | None = None  # staged: data pointers copied at once (staging.stage)

    def __getstate__(self) -> dict:
        """What a writer process gets: no staging pool (the rank's) and no process group (the
        writer runs on its own default group)."""
        return {**self.__dict__, "pool": None, "group": None, "now": None}

    def kept(self, state: dict) -> dict:
        """`state` with only this save's sections."""
        if self.sections is None:
            return state
        return {k: v for k, v in state.items() if k in self.sections}

    def record(self, *files) -> None:
        """Every writer of a checkpoint file calls this: the file is hashed by the rank that wrote it."""
        self.written.extend(Path(f) for f in files)

    def described_as(self, file, entry: dict) -> None:
        """`file`'s size and digest, taken from the bytes as they were written (no second read)."""
        self.described[Path(file)] = entry

    def save_file(self, name: str, obj) -> Path:
        """torch.save `obj` (plain data: read back with weights_only) as tmp/name."""
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(obj, path)
        self.record(path)
        return path

    def write_text(self, name: str, text: str) -> Path:
        path = self.tmp / name
        path.write_text(text)
        self.record(path)
        return path

    def queue(self, state: dict, planner, collective: bool) -> None:
        """A host copy of `state` (this rank's part only: O(model / N)) that no later training step
        can change, written by portable.write_queued."""
        from parallel.checkpoint.background.staging import stage

        self.queued.append((stage(state, self.pool, self.now), planner, collective))

    def placed(self, wait: bool = False) -> None:
        """Every copy `queue` placed is made or issued: buffers' at once, the rest completed by
        the pool on the saver's thread (HostPool.complete); `wait`: completed here (a save that
        failed half-way leaves nothing for the next one to copy)."""
        if self.pool is not None:
            self.pool.finish()
            if wait:
                self.pool.complete()

    def take_queued(self) -> list[tuple]:
        """The queued states, handed to the writer once (portable.write_queued): the sink is no
        longer staged afterwards."""
        queued, self.queued, self.staged = self.queued, [], False
        return queued
