"""A save's last steps, the same for a synchronous save, the background saver and the writer process:
this rank's files hashed and fsynced, then rank 0's manifest and the atomic rename
(`finish_checkpoint`), `latest` pointed at it and keep_last applied (`PendingSave.run`);
`write_checkpoint` for a one-off write (imports, tests). The directory itself: format/directory.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from parallel.checkpoint.format.directory import (
    _barrier,
    _fsync_dirs,
    _replace,
    begin_checkpoint,
    fsync_files,
    publish,
)
from parallel.checkpoint.format.manifest import FORMAT_VERSION, HASHES, MANIFEST, describe
from parallel.checkpoint.state.sink import Sink


def write_checkpoint(path: str | Path, rank: int, write: Callable[[Sink], None], meta: dict,
                     writers: int | None = None) -> Path:
    """Every rank calls this. `write(sink)` writes the rank's files into the sink's temporary
    directory (`sink.tmp`), recording each; each rank hashes and fsyncs what it wrote (in parallel:
    O(its files)); rank 0 then writes the manifest and renames the directory into place, so `path`
    is either the old complete checkpoint or the new complete one, never a mix. `writers`: the
    processes calling it (default: the process group)."""
    sink = Sink(begin_checkpoint(path, rank))
    write(sink)
    return finish_checkpoint(path, sink, rank, meta, writers)


@dataclass
class PendingSave:
    """One save after `save` returned: its staged state written, its small files, then the
    checkpoint finished (every rank's hashes, fsync, manifest, rename) and published. The same
    steps a synchronous save runs in place; a writer process runs it from a pickled copy."""

    path: Path
    sink: Sink
    small: dict  # name -> object (torch.save) or text, taken when `save` was called
    meta: dict
    rank: int
    publish: bool  # this rank points `latest` at it (the main rank, when `save` asked for it)
    keep: int | None
    managed: Path | None
    opened: bool  # sink.tmp made already (a synchronous save, which wrote its state into it)

    def run(self) -> None:
        from parallel.checkpoint.state.portable import write_queued

        if not self.opened:  # the writer's own barrier: none is left in the step's path
            begin_checkpoint(self.path, self.rank, self.sink.group)
        write_queued(self.sink)  # a staged save's state (nothing when it was written already)
        for name, obj in self.small.items():
            (self.sink.write_text if isinstance(obj, str) else self.sink.save_file)(name, obj)
        finish_checkpoint(self.path, self.sink, self.rank, self.meta)
        if self.publish:
            publish(self.path, self.keep, self.managed)


def finish_checkpoint(path: str | Path, sink: Sink, rank: int, meta: dict,
                      writers: int | None = None) -> Path:
    """After this rank's files are written (and recorded in `sink`): hash and fsync them, then rank
    0 publishes the directory once every rank has (collective over the sink's group)."""
    path, tmp, group = Path(path), sink.tmp, sink.group
    if writers is None:
        writers = dist.get_world_size(group) if dist.is_initialized() else 1
    # digests taken while writing where the writer took them (state_files.DigestingFileSystem), else
    # read back (the small files: trainer state, RNG, user state)
    own = {str(f.relative_to(tmp)): sink.described.get(f) or describe(f)
           for f in sorted(set(sink.written))}
    table = tmp / HASHES / f"rank{rank}.json"
    table.write_text(json.dumps(own, indent=0))
    fsync_files([*sink.written, table])
    _barrier(group)  # every rank's files are durable and hashed before the manifest says complete
    if rank == 0:
        manifest = {"format_version": FORMAT_VERSION, "writer": "polyshard", **meta,
                    "writers": writers}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
        fsync_files([tmp / MANIFEST])
        _fsync_dirs(tmp)
        _replace(tmp, path)
    _barrier(group)  # nobody returns before the checkpoint is in place
    return path
