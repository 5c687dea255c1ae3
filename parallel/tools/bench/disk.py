"""The disk's own bandwidth next to a checkpoint, for `polyshard bench --save`: a direct-I/O write
(O_DIRECT: the page cache is bypassed, as `dd oflag=direct` does) and a cold read (the file's cached
pages dropped first with posix_fadvise DONTNEED), of `size` bytes in 8 MiB blocks. What a
checkpoint's GB/s is a fraction of."""

from __future__ import annotations

import mmap
import os
import secrets
import time
from pathlib import Path

BLOCK = 8 << 20


def disk_gbps(directory: Path, size: int = 1 << 30) -> dict:
    """{"write_gbps", "read_gbps", "direct"} measured with a scratch file in `directory` (removed
    after); `direct` False where the file system refuses O_DIRECT (then an fsync'd buffered write)."""
    buffer = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(BLOCK))
    direct = getattr(os, "O_DIRECT", 0)
    # a new file of our own under a name no one can guess, created exclusively, no link followed
    # (a planted link or FIFO at the fixed name it had took the 1 GiB write, or hung: #65)
    path = Path(directory) / f".polyshard-disk-probe-{os.getpid()}-{secrets.token_hex(8)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
    made = False
    try:
        try:
            fd = os.open(path, flags | direct, 0o600)
        except FileExistsError:
            raise
        except OSError:  # a file system without direct I/O: the fsync'd write instead (the
            path.unlink(missing_ok=True)  # refused open may have made the file: ours, by its name)
            fd, direct = os.open(path, flags, 0o600), 0
        made = True
        try:
            start = time.perf_counter()
            for _ in range(size // BLOCK):
                os.write(fd, buffer)
            os.fsync(fd)
            write_s = time.perf_counter() - start
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while os.readv(fd, [buffer]):
                pass
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        if made:
            path.unlink(missing_ok=True)
        buffer.close()
    return {"write_gbps": size / write_s / 1e9, "read_gbps": size / read_s / 1e9,
            "direct": bool(direct)}


def rates(size: int, save_s: float, load_s: float, directory: Path) -> dict:
    """A checkpoint of `size` bytes saved and loaded in these seconds, in GB/s and as fractions of
    the disk's own direct write and cold read beside it."""
    disk = {f"disk_{k}": v for k, v in disk_gbps(directory).items()}
    save, load = size / save_s / 1e9, size / load_s / 1e9
    return {"bytes": size, "save_gbps": save, "load_gbps": load, **disk,
            "save_of_disk": save / disk["disk_write_gbps"],
            "load_of_disk": load / disk["disk_read_gbps"]}


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def evict(path: Path) -> None:
    """Drop the page cache's copy of every file under `path` (posix_fadvise DONTNEED, after an
    fsync): the next read of it is a cold read from the disk."""
    for f in Path(path).rglob("*"):
        if f.is_file() and not f.is_symlink():  # our own files: never a link's target
            fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
