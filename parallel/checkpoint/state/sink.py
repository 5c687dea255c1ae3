"""Where one save's files go, passed down explicitly from `save` to every writer.

A `Sink` is one checkpoint being written by one rank: its temporary directory, the files this rank
wrote there (each rank hashes and fsyncs its own: background/finishing.py), and how its state is
delivered, by type: `Sink` writes at once; `StagedSink` (checkpoint.async_save, background/saver.py)
copies it to host memory now for the background writer; `CaptureSink` (save_pretrained,
hf/hf_gather.py) hands DCP's write items to the Hugging Face writer instead of files. Nothing about
a save in flight lives in a module global, so two saves in flight, or a save on another thread, each
keep their own list and queue.
"""

from __future__ import annotations

from pathlib import Path

import torch


class Sink:
    """State written at once, as files under `tmp`/state."""

    kind = "files"  # DCP's plans are cached per kind of storage writer (portable.save_state)

    def __init__(self, tmp: str | Path, group=None, threads: int = 1,
                 sections: tuple[str, ...] | None = None, durable: bool = True):
        """`group`: the process group DCP's collective writes run over (the background saver's
        own, so they never meet the training loop's). `threads`: checkpoint.write_threads.
        `sections`: the portable state's top-level keys this save keeps ("model" alone for
        save_pretrained: no optimizer state written); None keeps all. `durable`: state files are
        fsynced (a checkpoint); False for a staging copy read back at once and removed (its pages
        need never reach the disk)."""
        self.tmp = Path(tmp)
        self.group = group
        self.written: list[Path] = []  # files this rank wrote under tmp, hashed by this rank
        # {file: {size, digest}} of files hashed as they were written (portable.py's DCP writer):
        # finish_checkpoint reads back only the others
        self.described: dict[Path, dict] = {}
        self.threads = threads  # DCP's writer threads for this rank's state files
        self.sections = sections
        self.durable = durable

    def __getstate__(self) -> dict:
        """What a writer process gets: no process group (the writer runs on its own default
        group)."""
        return {**self.__dict__, "group": None}

    def kept(self, state: dict) -> dict:
        """`state` with only this save's sections."""
        if self.sections is None:
            return state
        return {k: v for k, v in state.items() if k in self.sections}

    def defer(self, state: dict, planner, collective: bool) -> bool:
        """Keep `state` to write later and say True (StagedSink); this sink writes now."""
        return False

    def storage_writer(self):
        """DCP's storage writer of this sink's state; None: files under tmp/state, recorded and
        hashed as they are written (portable.save_state's RecordingWriter)."""
        return None

    def placed(self, wait: bool = False) -> None:
        """Every copy a deferring sink took is made or issued (StagedSink); nothing to do here."""

    def take_queued(self) -> list[tuple]:
        """The states a deferring sink kept, handed to the writer once (portable.write_queued)."""
        return []

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
