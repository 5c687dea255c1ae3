"""Checkpoint directories: written atomically, published by `latest`, pruned by `keep_last`.

Layout (format version 2, docs/checkpoint-format.md): `manifest.json` and `hashes/rank{r}.json` (what a
complete checkpoint is, and its verification: manifest.py), `state/` (model and optimizer state as
torch DCP, keyed by the original model's parameter names: parallel/checkpoint/state/portable.py),
`trainer.pt` (step, scheduler, data position), `rng/rank{r}.pt`, and `hf_config.json` for Hugging Face
models. Next to the checkpoints, `latest` names the newest complete one; it is replaced last.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from parallel.checkpoint.format.manifest import (
    HASHES,
    MANIFEST,
    read_manifest,
)
from parallel.checkpoint.format.safe import CheckpointError, UnsafeFileError, child_name, read_text
from parallel.files import write_atomic


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


STEP_NAME = re.compile(r"step-\d{1,18}")  # the checkpoints maybe_save writes, and keep_last may remove


def begin_checkpoint(path: str | Path, rank: int, group=None) -> Path:
    """Rank 0 makes the temporary directory every rank then writes into (collective). Every rank
    first checks that `path` is free or a polyshard checkpoint (it is replaced only then), so all
    refuse alike, before the barrier."""
    path = Path(path)
    ensure_replaceable(path)
    tmp = partial_path(path)
    if rank == 0:
        remove_ours(tmp)  # a previous crash's leftover; a planted link is removed, not followed
        _restore_after_crash(path)
        (tmp / HASHES).mkdir(parents=True)
    _barrier(group)  # the directory must exist before any rank writes into it
    return tmp


def partial_path(path: Path) -> Path:
    """Where a checkpoint of `path` is written before it is complete."""
    return path.with_name(f".{path.name}.partial")


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


def remove_ours(tmp: Path) -> None:
    """Remove a temporary path polyshard names (.NAME.partial / .NAME.old): a link is unlinked,
    never followed into what it points at."""
    if tmp.is_symlink() or tmp.is_file():
        tmp.unlink()
    elif tmp.is_dir():
        shutil.rmtree(tmp)


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
    if (not (path / MANIFEST).exists() and not previous.is_symlink()
            and (previous / MANIFEST).is_file()):  # our own copy, never a planted link out
        return previous
    return path


def publish(path: Path, keep_last: int | None, managed: Path | None = None) -> None:
    """Rank 0, after `path` is complete: point `latest` at it (write, fsync, rename), then, when
    `path` lies in the directory polyshard manages (`checkpoint.dir`), delete all but the newest
    `keep_last` checkpoints there. A crash before the rename leaves `latest` on the previous complete
    checkpoint; retention runs only once the pointer has moved. Deleted are only directories named
    step-N whose manifest polyshard wrote: a sibling with a manifest of its own (a web app's, a
    dataset's, an imported checkpoint under another name) is never touched."""
    # a temporary file of this process's own (two jobs publishing into one folder at once each
    # replace `latest` whole), never written through a planted link
    write_atomic(path.parent / LATEST, (path.name + "\n").encode())
    if keep_last is None or managed is None or path.parent.resolve() != Path(managed).resolve():
        return
    ours = sorted(_older_steps(path))
    for _, old in ours[:max(0, len(ours) + 1 - keep_last)]:
        shutil.rmtree(old)


def _older_steps(path: Path):
    """(step, directory) of the checkpoints maybe_save wrote before `path`, ordered by the step in
    their names, never by what a manifest claims: a planted step-99999999 whose manifest says step
    10**18 neither outranks the user's checkpoints nor counts among them. A directory is a candidate
    only when its name, its manifest and the order agree (step-N, manifest step N, N below the
    step being published); anything else is not ours to judge, and is left alone."""
    now = _name_step(path.name)
    for d in path.parent.iterdir():
        step = step_checkpoint(d)
        if d != path and step is not None and (now is None or step < now):
            yield step, d


def step_checkpoint(d: Path) -> int | None:
    """N for a checkpoint maybe_save wrote as step-N: a directory (not a link) named step-N whose
    manifest polyshard wrote says step N; None for anything else (a planted step-00000009 whose
    manifest claims step 10**18 is not one, for retention and for resume's fallback alike)."""
    step = _name_step(d.name)
    if step is None or not is_ours(d):
        return None
    manifest = read_manifest(d)
    return step if manifest["step"] == step and manifest.get("writer") == "polyshard" else None


def _name_step(name: str) -> int | None:
    return int(name[5:]) if STEP_NAME.fullmatch(name) else None


def fsync_files(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dirs(root: Path) -> None:
    """The directories' entries (the files themselves were fsynced by the ranks that wrote them)."""
    fsync_files([e.path for e in os.scandir(root) if e.is_dir()] + [root])  # no listing of files


def _replace(tmp: Path, path: Path) -> None:
    """`tmp` becomes `path`; a previous checkpoint there is kept as .NAME.old until the new one is in
    place, so a crash at any point leaves one complete copy: `path`, or .NAME.old, which resolve()
    reads and the next save of that name restores first (_restore_after_crash)."""
    old = path.with_name(f".{path.name}.old")
    _restore_after_crash(path)
    remove_ours(old)
    if path.exists():
        path.rename(old)  # keep the previous checkpoint until the new one is in place
    tmp.rename(path)
    fsync_files([path.parent])
    remove_ours(old)


def _restore_after_crash(path: Path) -> None:
    """A crash between _replace's two renames left .NAME.old and no NAME: put it back."""
    old = path.with_name(f".{path.name}.old")
    if not path.exists() and not old.is_symlink() and (old / MANIFEST).is_file():
        old.rename(path)


def library_versions(packages: tuple[str, ...] = ()) -> dict:
    """Versions of what wrote a checkpoint, read from package metadata (nothing is imported):
    torch, the backend's `packages` (its descriptor's), transformers and accelerate."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("polyshard", "torch", *packages, "transformers", "accelerate"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found
