"""Checkpoint directories: written atomically, described by a manifest, verified before loading.

Layout (format version 2, docs/checkpoint-format.md): `manifest.json` (format, backend, world size,
step, spec, versions), `hashes/rank{r}.json` (size and sha256 of every file rank r wrote, hashed by
that rank, in parallel with the others), `state/` (model and optimizer state as torch DCP, keyed by the
original model's parameter names: parallel/checkpoint/portable.py), `trainer.pt` (step, scheduler,
data position), `rng/rank{r}.pt`, and `hf_config.json` for Hugging Face models. Next to the
checkpoints, `latest` names the newest complete one; it is replaced last. Version 1 (every file's hash
in the manifest, hashed by rank 0) is still read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

FORMAT_VERSION = 2
READS = (1, 2)  # format versions this polyshard loads (tests/unit/test_format_versions.py)
MANIFEST = "manifest.json"
HASHES = "hashes"
WRITTEN: list[Path] = []  # files this process wrote into the checkpoint being written


def record_written(*files) -> None:
    """Every writer of a checkpoint file calls this: the file is hashed by the rank that wrote it."""
    WRITTEN.extend(Path(f) for f in files)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupted; the message names the file."""


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def write_checkpoint(path: str | Path, rank: int, write: Callable[[Path], None], meta: dict,
                     writers: int | None = None) -> Path:
    """Every rank calls this. `write(tmp)` writes the rank's files into a temporary directory; each
    rank hashes and fsyncs what it wrote (in parallel: O(its files)); rank 0 then writes the manifest
    and renames the directory into place, so `path` is either the old complete checkpoint or the new
    complete one, never a mix. `writers`: the processes calling it (default: the process group)."""
    tmp = begin_checkpoint(path, rank)
    WRITTEN.clear()
    write(tmp)
    return finish_checkpoint(path, tmp, rank, meta, writers)


def begin_checkpoint(path: str | Path, rank: int, group=None) -> Path:
    """Rank 0 makes the temporary directory every rank then writes into (collective)."""
    tmp = Path(path).with_name(f".{Path(path).name}.partial")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / HASHES).mkdir(parents=True)
    _barrier(group)  # the directory must exist before any rank writes into it
    return tmp


def finish_checkpoint(path: str | Path, tmp: Path, rank: int, meta: dict, writers: int | None = None,
                      group=None) -> Path:
    """After this rank's files are written (and listed in WRITTEN): hash and fsync them, then rank 0
    publishes the directory once every rank has (collective over `group`)."""
    path = Path(path)
    if writers is None:
        writers = dist.get_world_size(group) if dist.is_initialized() else 1
    own = {str(f.relative_to(tmp)): _describe(f) for f in sorted(set(WRITTEN))}
    table = tmp / HASHES / f"rank{rank}.json"
    table.write_text(json.dumps(own, indent=0))
    _fsync_files([*WRITTEN, table])
    WRITTEN.clear()
    _barrier(group)  # every rank's files are durable and hashed before the manifest says complete
    if rank == 0:
        manifest = {"format_version": FORMAT_VERSION, **meta, "writers": writers}
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
    try:
        manifest = json.loads(manifest_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{manifest_file}: unreadable manifest ({err})") from None
    version = manifest.get("format_version")
    if version not in READS:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise CheckpointError(
            f"{manifest_file}: format_version {version!r}; this polyshard reads versions "
            f"{', '.join(map(str, READS))} and writes {FORMAT_VERSION}. " + (
                "It was written by a newer polyshard: upgrade this one (pip install -U polyshard) "
                "to load it." if newer else "It is not a polyshard checkpoint format."))
    return manifest


def _tables(path: Path, manifest: dict, rank: int = 0, world: int = 1) -> dict[str, dict]:
    """{file: {size, sha256}} of this rank's share: the tables of writers rank, rank + world, ...
    (version 1: the manifest's one table, split the same way by position)."""
    if manifest["format_version"] == 1:
        return dict(list(manifest["files"].items())[rank::world])
    out = {}
    for writer in range(rank, manifest["writers"], world):
        table = path / HASHES / f"rank{writer}.json"
        if not table.is_file():
            raise CheckpointError(f"{table}: missing (rank {writer}'s file hashes)")
        try:
            out.update(json.loads(table.read_text()))
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{table}: unreadable ({err})") from None
    return out


def _check(path: Path, table: dict[str, dict], workers: int = 1) -> None:
    def one(item):
        name, expected = item
        if not (path / name).is_file():
            return f"{path / name}: listed in the checkpoint's hashes but missing"
        actual = _describe(path / name)
        if actual["size"] != expected["size"]:
            return (f"{path / name}: size {actual['size']} bytes, the checkpoint says "
                    f"{expected['size']} (truncated or overwritten)")
        if actual["sha256"] != expected["sha256"]:
            return f"{path / name}: sha256 mismatch (corrupted)"
        return None

    with ThreadPoolExecutor(max(1, workers)) as pool:  # hashlib releases the GIL on large blocks
        problems = [p for p in pool.map(one, sorted(table.items())) if p]
    if problems:
        raise CheckpointError(problems[0] + (f" (and {len(problems) - 1} more files)"
                                             if len(problems) > 1 else ""))


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


def verify_parallel(path: str | Path) -> dict:
    """Every rank reads the manifest and checks its share of the files (the tables of writer ranks
    r, r + N, ...): O(checkpoint / N) reading per rank, in parallel. A failure on any rank fails every
    rank before anything is loaded, each naming the file (one all-reduce and one broadcast)."""
    path = Path(path)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    error = None
    try:
        manifest = read_manifest(path)
        _check(path, _tables(path, manifest, rank, world))
    except CheckpointError as err:
        error = str(err)
    if world == 1:
        if error:
            raise CheckpointError(error)
        return manifest
    flag = torch.tensor([rank if error else world])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    first = int(flag)
    if first < world:
        message = [error]
        dist.broadcast_object_list(message, src=first)
        raise CheckpointError(message[0] + (f" (found by rank {first})" if first != rank else ""))
    return manifest


LATEST = "latest"


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or a directory of checkpoints whose `latest` file names one."""
    path = Path(path)
    pointer = path / LATEST
    if not (path / MANIFEST).exists() and pointer.is_file():
        return path / pointer.read_text().strip()
    return path


def publish(path: Path, keep_last: int | None) -> None:
    """Rank 0, after `path` is complete: point `latest` at it (write, fsync, rename), then delete
    all but the newest `keep_last` checkpoints beside it. A crash before the rename leaves `latest`
    on the previous complete checkpoint; retention runs only once the pointer has moved."""
    tmp = path.parent / f".{LATEST}.partial"
    tmp.write_text(path.name + "\n")
    fd = os.open(tmp, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    tmp.rename(path.parent / LATEST)
    if keep_last is None:
        return
    siblings = [d for d in path.parent.iterdir() if (d / MANIFEST).is_file() and d != path]
    siblings.sort(key=lambda d: (_step(d), d.stat().st_mtime))
    for old in siblings[:max(0, len(siblings) + 1 - keep_last)]:
        shutil.rmtree(old, ignore_errors=True)


def _step(path: Path) -> int:
    try:
        return int(json.loads((path / MANIFEST).read_text()).get("step", -1))
    except (OSError, ValueError):
        return -1


def save_rank_file(obj, tmp: Path, subdir: str, rank: int) -> None:
    (tmp / subdir).mkdir(exist_ok=True)
    torch.save(obj, tmp / subdir / f"rank{rank}.pt")
    record_written(tmp / subdir / f"rank{rank}.pt")


def _describe(file: Path) -> dict:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"size": file.stat().st_size, "sha256": digest.hexdigest()}


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
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)  # keep the previous checkpoint until the new one is in place
    tmp.rename(path)
    fd = os.open(path.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    shutil.rmtree(old, ignore_errors=True)


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
