"""Checkpoint directories: written atomically, described by a manifest, verified before loading.

Layout (format version 2, docs/checkpoint-format.md): `manifest.json` (format, backend, world size,
step, spec, versions), `hashes/rank{r}.json` (size and digest of every file rank r wrote, hashed by
that rank, in parallel with the others), `state/` (model and optimizer state as torch DCP, keyed by the
original model's parameter names: parallel/checkpoint/portable.py), `trainer.pt` (step, scheduler,
data position), `rng/rank{r}.pt`, and `hf_config.json` for Hugging Face models. Next to the
checkpoints, `latest` names the newest complete one; it is replaced last. Version 1 (every file's hash
in the manifest, hashed by rank 0) is still read.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

from parallel.checkpoint.sink import Sink
from parallel.checkpoint.safe import (  # noqa: F401 - CheckpointError is imported from here too
    TABLE_LIMIT,
    CheckpointError,
    UnsafeFileError,
    child_name,
    load_json,
    read_text,
    relative_inside,
)

FORMAT_VERSION = 2
READS = (1, 2)
MAX_WRITERS = 1 << 20  # ranks that may have written one checkpoint
STEP_NAME = re.compile(r"step-\d+")  # the checkpoints maybe_save writes, and keep_last may remove  # format versions this polyshard loads (tests/unit/test_format_versions.py)
MANIFEST = "manifest.json"
HASHES = "hashes"

def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


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


def begin_checkpoint(path: str | Path, rank: int, group=None) -> Path:
    """Rank 0 makes the temporary directory every rank then writes into (collective). Every rank
    first checks that `path` is free or a polyshard checkpoint (it is replaced only then), so all
    refuse alike, before the barrier."""
    path = Path(path)
    ensure_replaceable(path)
    tmp = path.with_name(f".{path.name}.partial")
    if rank == 0:
        _remove_ours(tmp)  # a previous crash's leftover; a planted link is removed, not followed
        _restore_after_crash(path)
        (tmp / HASHES).mkdir(parents=True)
    _barrier(group)  # the directory must exist before any rank writes into it
    return tmp


def ensure_replaceable(path: Path) -> None:
    """`path` may be written only when it does not exist or is a checkpoint polyshard wrote."""
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_symlink() or not path.is_dir() or not is_ours(path):
        raise CheckpointError(f"{path}: exists and is not a polyshard checkpoint; polyshard replaces "
                              "only checkpoints it wrote. Save to another path, or move it away")


def is_ours(path: Path) -> bool:
    """A directory (not a link) whose manifest polyshard wrote: a format it reads, with the step and
    world size every polyshard manifest carries."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        manifest = read_manifest(path)
    except CheckpointError:
        return False
    return isinstance(manifest.get("step"), int) and isinstance(manifest.get("world_size"), int)


def _remove_ours(tmp: Path) -> None:
    """Remove a temporary path polyshard names (.NAME.partial / .NAME.old): a link is unlinked,
    never followed into what it points at."""
    if tmp.is_symlink() or tmp.is_file():
        tmp.unlink()
    elif tmp.is_dir():
        shutil.rmtree(tmp)


def finish_checkpoint(path: str | Path, sink: Sink, rank: int, meta: dict,
                      writers: int | None = None) -> Path:
    """After this rank's files are written (and recorded in `sink`): hash and fsync them, then rank
    0 publishes the directory once every rank has (collective over the sink's group)."""
    path, tmp, group = Path(path), sink.tmp, sink.group
    if writers is None:
        writers = dist.get_world_size(group) if dist.is_initialized() else 1
    own = {str(f.relative_to(tmp)): _describe(f) for f in sorted(set(sink.written))}
    table = tmp / HASHES / f"rank{rank}.json"
    table.write_text(json.dumps(own, indent=0))
    _fsync_files([*sink.written, table])
    _barrier(group)  # every rank's files are durable and hashed before the manifest says complete
    if rank == 0:
        manifest = {"format_version": FORMAT_VERSION, "writer": "polyshard", **meta,
                    "writers": writers}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
        _fsync_files([tmp / MANIFEST])
        _fsync_dirs(tmp)
        _replace(tmp, path)
    _barrier(group)  # nobody returns before the checkpoint is in place
    return path


def read_manifest(path: str | Path) -> dict:
    path = Path(path)
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"{manifest_file}: manifest missing; {path} is not a complete "
                              "polyshard checkpoint")
    manifest = load_json(manifest_file, "a checkpoint manifest", TABLE_LIMIT, follow=False)
    if not isinstance(manifest, dict):
        raise UnsafeFileError(f"{manifest_file}: a manifest is a JSON object, not "
                              f"{type(manifest).__name__}")
    version = manifest.get("format_version")
    if version not in READS:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise CheckpointError(
            f"{manifest_file}: format_version {version!r}; this polyshard reads versions "
            f"{', '.join(map(str, READS))} and writes {FORMAT_VERSION}. " + (
                "It was written by a newer polyshard: upgrade this one (pip install -U polyshard) "
                "to load it." if newer else "It is not a polyshard checkpoint format."))
    kinds = {"world_size": int, "step": int, "writers": int, "backend": str}
    wrong = [k for k, kind in kinds.items() if k in manifest and (
        not isinstance(manifest[k], kind) or isinstance(manifest[k], bool))]
    if wrong or (version == 1 and not isinstance(manifest.get("files"), dict)):
        raise UnsafeFileError(f"{manifest_file}: {wrong or ['files']} of the wrong type; not a "
                              "manifest polyshard wrote")
    if not 0 < manifest.get("writers", 1) <= MAX_WRITERS:
        raise UnsafeFileError(f"{manifest_file}: writers {manifest['writers']} out of range")
    return manifest


def _tables(path: Path, manifest: dict, rank: int = 0, world: int = 1) -> dict[str, dict]:
    """{file: {size, digest}} of this rank's share: the tables of writers rank, rank + world, ...
    (version 1: the manifest's one table, split the same way by position)."""
    if manifest["format_version"] == 1:
        return _typed(dict(list(manifest["files"].items())[rank::world]), path / MANIFEST)
    out = {}
    for writer in range(rank, manifest["writers"], world):
        table = path / HASHES / f"rank{writer}.json"
        if not table.is_file():
            raise CheckpointError(f"{table}: missing (rank {writer}'s file hashes)")
        out.update(_typed(load_json(table, "a hash table", TABLE_LIMIT, follow=False), table))
    return out


def _typed(table, source: Path) -> dict[str, dict]:
    """A hash table as {relative file: {size: int, DIGEST: hex}} (DIGEST xxh3_128, or sha256 in
    checkpoints written before), every file inside the checkpoint."""
    if not isinstance(table, dict):
        raise UnsafeFileError(f"{source}: a hash table is a JSON object of files")
    root = source.parent.parent if source.parent.name == HASHES else source.parent
    for name, entry in table.items():
        relative_inside(name, root, f"{source.name}'s entry")
        if not (isinstance(entry, dict) and isinstance(entry.get("size"), int)
                and any(isinstance(entry.get(d), str) for d in DIGESTS)):
            raise UnsafeFileError(f"{source}: the entry of {name!r} is not {{size, digest}}")
    return table


def _problems(path: Path, table: dict[str, dict], workers: int = 1) -> str | None:
    """The first damaged file of `table` (named, with what is wrong), or None."""
    def one(item):
        name, expected = item
        if (path / name).is_symlink():  # its size and hash would be another file's
            return f"{path / name}: a symbolic link inside a checkpoint (refused)"
        if not (path / name).is_file():
            return f"{path / name}: listed in the checkpoint's hashes but missing"
        kind = next(d for d in DIGESTS if d in expected)
        size = (path / name).stat().st_size
        if size != expected["size"]:
            return (f"{path / name}: size {size} bytes, the checkpoint says "
                    f"{expected['size']} (truncated or overwritten)")
        if _digest(path / name, kind) != expected[kind]:
            return f"{path / name}: {kind} mismatch (corrupted)"
        return None

    with ThreadPoolExecutor(max(1, workers)) as pool:  # hashlib releases the GIL on large blocks
        problems = [p for p in pool.map(one, sorted(table.items())) if p]
    if problems:
        return problems[0] + (f" (and {len(problems) - 1} more files)" if len(problems) > 1 else "")
    return None


def _check(path: Path, table: dict[str, dict], workers: int = 1) -> None:
    problem = _problems(path, table, workers)
    if problem:
        raise CheckpointError(problem)


def verify_checkpoint(path: str | Path, workers: int | None = None) -> dict:
    """One process checks everything (`polyshard ckpt verify`): the manifest, then every file's size
    and sha256 on `workers` threads, and that no file on disk is unaccounted for. Returns the
    manifest with `files` (every file's entry)."""
    path = Path(path)
    manifest = read_manifest(path)
    table = _tables(path, manifest)
    _check(path, table, workers or min(8, os.cpu_count() or 1))
    known = {*table, MANIFEST, *(f"{HASHES}/rank{r}.json" for r in range(manifest.get("writers", 0)))}
    stray = [str(f.relative_to(path)) for f in path.rglob("*")
             if f.is_file() and str(f.relative_to(path)) not in known]
    if stray:
        raise CheckpointError(f"{path / stray[0]}: not listed in the checkpoint's hashes "
                              f"({len(stray)} such files): written after the checkpoint completed?")
    return {**manifest, "files": table}


class Verification:
    """Every rank checks its share of a checkpoint's files (the tables of writer ranks r, r + N, ...:
    O(checkpoint / N) reading per rank) on a thread of its own while the state is read, and agree()
    fails every rank, each naming the file, when any rank found one damaged (one all-reduce and one
    broadcast). The manifest and tables are read at once, and a malformed one raises on its rank
    before any collective (every rank reads the same files, so all raise alike)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.rank, self.world = ((dist.get_rank(), dist.get_world_size()) if dist.is_initialized()
                                 else (0, 1))
        self.manifest = read_manifest(self.path)
        table = _tables(self.path, self.manifest, self.rank, self.world)
        self._pool = ThreadPoolExecutor(1)
        self._found = self._pool.submit(_problems, self.path, table)

    def agree(self) -> dict:
        """Collective: wait for this rank's digests, then raise everywhere if any rank found damage."""
        error = self._found.result()
        self._pool.shutdown()
        if self.world == 1:
            if error:
                raise CheckpointError(error)
            return self.manifest
        flag = torch.tensor([self.rank if error else self.world])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        first = int(flag)
        if first < self.world:
            message = [error]
            dist.broadcast_object_list(message, src=first)
            raise CheckpointError(message[0] + (f" (found by rank {first})" if first != self.rank
                                                else ""))
        return self.manifest


LATEST = "latest"


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or a directory of checkpoints whose `latest` file names one (a plain
    name inside it). A checkpoint being replaced when a crash came between the two renames is found
    under its previous copy (_replace)."""
    path = Path(path)
    pointer = path / LATEST
    if not (path / MANIFEST).exists() and (pointer.exists() or pointer.is_symlink()):
        name = read_text(pointer, "a `latest` pointer", 4096, follow=False).strip()
        path = path / child_name(name, "its `latest` file names", path)
        if path.is_symlink():
            raise UnsafeFileError(f"{path}: `latest` names a symbolic link, not a checkpoint")
    previous = path.with_name(f".{path.name}.old")
    if not (path / MANIFEST).exists() and (previous / MANIFEST).is_file():
        return previous
    return path


def publish(path: Path, keep_last: int | None, managed: Path | None = None) -> None:
    """Rank 0, after `path` is complete: point `latest` at it (write, fsync, rename), then, when
    `path` lies in the directory polyshard manages (`checkpoint.dir`), delete all but the newest
    `keep_last` checkpoints there. A crash before the rename leaves `latest` on the previous complete
    checkpoint; retention runs only once the pointer has moved. Deleted are only directories named
    step-N whose manifest polyshard wrote: a sibling with a manifest of its own (a web app's, a
    dataset's, an imported checkpoint under another name) is never touched."""
    tmp = path.parent / f".{LATEST}.partial"
    _remove_ours(tmp)  # a planted link is removed, never written through
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, (path.name + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.rename(path.parent / LATEST)
    if keep_last is None or managed is None or path.parent.resolve() != Path(managed).resolve():
        return
    ours = [(read_manifest(d)["step"], d) for d in path.parent.iterdir()
            if d != path and STEP_NAME.fullmatch(d.name) and is_ours(d)]
    ours.sort()
    for _, old in ours[:max(0, len(ours) + 1 - keep_last)]:
        shutil.rmtree(old)


# What a hash table records of each file. xxh3-128 (xxhash, the non-cryptographic digest datasets and
# zstd use) hashes at 22 GB/s on one core here against sha256's 1.8 GB/s: verifying on load cost
# about as much as reading the checkpoint (polyshard load 1.84x plain DCP, issue #27). It detects
# truncation and damage as sha256 does; neither proves who wrote a file (docs/security.md), so nothing
# is lost. sha256 tables of earlier checkpoints are still checked.
DIGEST = "xxh3_128"
DIGESTS = (DIGEST, "sha256")


def _digest(file: Path, kind: str) -> str:
    """The file's digest, hashed from a read-only memory map: no copy into Python buffers (a 350 MB
    shard: 14 ms, against 22 ms read in 4 MB blocks)."""
    digest = xxhash.xxh3_128() if kind == DIGEST else hashlib.sha256()
    with open(file, "rb") as f:
        if os.fstat(f.fileno()).st_size:  # mmap refuses an empty file
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                digest.update(mapped)
    return digest.hexdigest()


def _describe(file: Path) -> dict:
    return {"size": file.stat().st_size, DIGEST: _digest(file, DIGEST)}


def _fsync_files(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dirs(root: Path) -> None:
    """The directories' entries (the files themselves were fsynced by the ranks that wrote them)."""
    _fsync_files([e.path for e in os.scandir(root) if e.is_dir()] + [root])  # no listing of files


def _replace(tmp: Path, path: Path) -> None:
    """`tmp` becomes `path`; a previous checkpoint there is kept as .NAME.old until the new one is in
    place, so a crash at any point leaves one complete copy: `path`, or .NAME.old, which resolve()
    reads and the next save of that name restores first (_restore_after_crash)."""
    old = path.with_name(f".{path.name}.old")
    _restore_after_crash(path)
    _remove_ours(old)
    if path.exists():
        path.rename(old)  # keep the previous checkpoint until the new one is in place
    tmp.rename(path)
    _fsync_files([path.parent])
    _remove_ours(old)


def _restore_after_crash(path: Path) -> None:
    """A crash between _replace's two renames left .NAME.old and no NAME: put it back."""
    old = path.with_name(f".{path.name}.old")
    if not path.exists() and not old.is_symlink() and (old / MANIFEST).is_file():
        old.rename(path)


def library_versions() -> dict:
    """Versions of what wrote a checkpoint, read from package metadata (nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    from parallel import __version__
    from parallel.registry import packages

    found = {"polyshard": __version__}
    for name in ("torch", *packages(), "transformers", "accelerate"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found
