"""Checkpoint directories: written atomically, described by a manifest, verified before loading.

Layout (format version 1): `manifest.json` (format, backend, world size, step, versions, and every file's
size and sha256), `trainer.pt` (step, scheduler, data position), `rng/rank{r}.pt`, and the model and
optimizer state written by the backend (`model_optim/` as torch DCP, or `model_optim.pt` when full).
Keys are the original model's parameter names, whatever wrapper trained it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupted; the message names the file."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def write_checkpoint(path: str | Path, rank: int, write: Callable[[Path], None], meta: dict) -> Path:
    """Every rank calls this. `write(tmp)` writes the rank's files into a temporary directory; rank 0
    then records the manifest, fsyncs, and renames the directory into place, so `path` is either the
    old complete checkpoint or the new complete one, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()  # the directory must exist before any rank writes into it
    write(tmp)
    _barrier()  # every rank's files must be complete before the manifest lists them
    if rank == 0:
        files = {str(f.relative_to(tmp)): _describe(f) for f in sorted(tmp.rglob("*")) if f.is_file()}
        manifest = {"format_version": FORMAT_VERSION, **meta, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
        _fsync_tree(tmp)
        _replace(tmp, path)
    _barrier()  # nobody returns before the checkpoint is in place
    return path


def verify_checkpoint(path: str | Path) -> dict:
    """Check the manifest, then every file's size and sha256; return the manifest."""
    path = Path(path)
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"{manifest_file}: manifest missing; {path} is not a complete "
                              "polyshard checkpoint")
    try:
        manifest = json.loads(manifest_file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{manifest_file}: unreadable manifest ({err})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{manifest_file}: format_version {manifest.get('format_version')!r}, "
                              f"this polyshard reads {FORMAT_VERSION}")
    for name, expected in manifest["files"].items():
        actual = _describe(path / name) if (path / name).is_file() else None
        if actual is None:
            raise CheckpointError(f"{path / name}: listed in the manifest but missing")
        if actual["size"] != expected["size"]:
            raise CheckpointError(f"{path / name}: size {actual['size']} bytes, manifest says "
                                  f"{expected['size']} (truncated or overwritten)")
        if actual["sha256"] != expected["sha256"]:
            raise CheckpointError(f"{path / name}: sha256 mismatch (corrupted)")
    return manifest


def verify_on_rank0(path: str | Path) -> dict:
    """Rank 0 reads and hashes; every rank gets the manifest or raises the same error."""
    result: list = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result[0] = verify_checkpoint(path)
        except CheckpointError as err:
            result[0] = err
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], CheckpointError):
        raise CheckpointError(str(result[0]))
    return result[0]


def save_rank_file(obj, tmp: Path, subdir: str, rank: int) -> None:
    (tmp / subdir).mkdir(exist_ok=True)
    torch.save(obj, tmp / subdir / f"rank{rank}.pt")


def _describe(file: Path) -> dict:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"size": file.stat().st_size, "sha256": digest.hexdigest()}


def _fsync_tree(root: Path) -> None:
    for f in root.rglob("*"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(root, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


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
