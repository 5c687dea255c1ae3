"""DeepSpeed's just-in-time ops, which a CPU job builds on first use on each host: its shared-memory
communication op (built by `deepspeed.init_distributed` on the CPU accelerator) and `cpu_adam`
(`deepspeed.cpu_adam: true`). Measured on this 2-core host: 28 s and 44 s cold (up to 300 s on a busy
host), then loaded from torch's extension cache in a second.

Two things made that silent: a first build says nothing for minutes, and, up to torch 2.14, a build
that was killed left torch's lock file (`<cache>/<op>/lock`, created by FileBaton and held open by the
builder) behind, so every later job waited on it for ever, saying nothing. Here a build is announced
with its expected time. Where torch still uses FileBaton (the XLA lane's torch 2.9), a lock no process
holds open is refused, naming the file and the fix, before DeepSpeed waits on it; torch 2.15 holds an
OS-level lock on that file instead (cpp_extension's FileLock: the file stays, the kernel releases the
lock with its holder), so there nothing is checked: torch's own fix is used.
`python -m backends.deepspeed.runtime.ops [NAME ...]` builds them ahead (`make` runs it once, at set-up: make
test the shared-memory op alone, make test-full and the demo both).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

OPS = {"deepspeed_shm_comm": ("ShareMemCommBuilder", 28), "cpu_adam": ("CPUAdamBuilder", 44)}


def extension_root() -> Path:
    """Where torch builds and caches extensions for this python and torch build: as torch's
    `_get_build_directory` decides it, TORCH_EXTENSIONS_DIR itself where it is set (no python /
    CUDA folder under it: naming one there made every lock check and build notice look in a
    directory torch never uses), else a folder per python and CUDA build under torch's default."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    if chosen is not None:
        return Path(chosen)
    cuda = torch.version.cuda
    flavour = f"cu{cuda.replace('.', '')}" if cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{flavour}"


def held_open(path: Path) -> bool:
    """Does any process hold `path` open (a builder's FileBaton does, until it releases)? A builder
    runs as this user, whose processes' descriptors /proc shows; those it does not show (the
    sandbox's init, other users') build nothing in this user's cache."""
    target = str(path.resolve())
    for fds in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fds.iterdir()):
                return True
        except OSError:  # gone, or not ours to read
            continue
    return False


def check_locks(root: Path | None = None) -> None:
    """Refuse a build lock no process holds (a killed build's): DeepSpeed would wait on it for
    ever. Nothing to do where torch locks the file itself (cpp_extension's FileLock, torch 2.15)."""
    import torch.utils.cpp_extension as cpp

    if hasattr(cpp, "FileLock"):
        return
    root = root or extension_root()
    for lock in sorted(root.glob("*/lock")):
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # released while we looked
            continue
        if not held_open(lock) and lock.exists():
            raise RuntimeError(
                f"{lock}: a build of the extension {lock.parent.name!r} left its lock behind "
                f"{age / 60:.0f} min ago and no process is building it (a killed build); every "
                "DeepSpeed job on this host would wait on it silently. Remove it (rm "
                f"{lock}) and start again: the op is built anew")


def announce_builds(names, say) -> None:
    """Say, once per op about to be built on this host, what it is and how long it takes."""
    root = extension_root()
    for name in names:
        builder, seconds = OPS[name]
        if not (root / name / f"{name}.so").is_file():
            say(f"DeepSpeed builds its {name} op ({builder}) on first use on this host: about "
                f"{seconds} s on 2 cores, up to minutes on a busy host; later jobs load it from "
                f"{root / name}. `python -m backends.deepspeed.runtime.ops` builds it ahead")


def build(names=tuple(OPS)) -> None:
    """Build (or load from the cache) each op, saying how long it took."""
    from backends.deepspeed.runtime.library import import_deepspeed

    import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    check_locks()
    for name in names:
        start = time.perf_counter()
        builder = get_accelerator().create_op_builder(OPS[name][0])
        if builder is None:
            print(f"{name}: not built by this accelerator ({get_accelerator().device_name()})")
            continue
        builder.load(verbose=False)
        print(f"{name}: ready in {time.perf_counter() - start:.1f} s ({extension_root() / name})")


if __name__ == "__main__":
    unknown = sorted(set(sys.argv[1:]) - set(OPS))
    if unknown:
        sys.exit(f"unknown op(s) {unknown}: choose from {sorted(OPS)}")
    build(tuple(sys.argv[1:]) or tuple(OPS))
