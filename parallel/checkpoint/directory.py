"""Checkpoint directories: written atomically, described by a manifest, verified before loading.

Layout (format version 1, docs/checkpoint-format.md): `manifest.json` (format, backend, world size,
step, spec, versions, and every file's size and sha256), `state/` (model and optimizer state as torch
DCP, keyed by the original model's parameter names: parallel/portable.py), `trainer.pt` (step,
scheduler, data position), `rng/rank{r}.pt`, and `hf_config.json` for Hugging Face models. Next to the
checkpoints, `latest` names the newest complete one; it is replaced last.
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


def hf_config_json(model) -> str | None:
    """A Hugging Face model's config as JSON, found through any wrapper."""
    for module in (model.modules() if model is not None else ()):
        config = getattr(module, "config", None)
        if hasattr(config, "to_json_string"):
            return config.to_json_string()
    return None
