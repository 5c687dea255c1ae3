"""checkpoint.dir is one directory for every rank: checked once when the engine starts. A job whose
nodes each see a directory of their own (a node-local path, a mount missing on one host) would
write a checkpoint no rank can read whole, and resume each node from its own past. Rank 0 writes a
file named by a random number every rank receives, every rank looks for it, rank 0 deletes it:
three small collectives at start-up, none per step; nothing else is written or removed."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.dist import WORLD, all_max
from parallel.spec.errors import SpecError

PROBE = ".polyshard-shared-{:014x}"


def check_shared(root: str | None, rank: int, device: torch.device) -> None:
    """Raise SpecError naming checkpoint.dir on every rank when a rank does not see the file rank
    0 wrote there (none where there is no directory, one rank, or a fake process group)."""
    if not root or not dist.is_initialized() or dist.get_world_size() == 1 or \
            "fake" in str(dist.get_backend()).lower():
        return
    mine = int.from_bytes(os.urandom(7), "big") if rank == 0 else 0
    nonce = int(all_max(torch.tensor([mine], dtype=torch.int64, device=device), WORLD).item())
    probe = Path(root) / PROBE.format(nonce)
    if rank == 0:
        probe.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
        os.write(fd, str(nonce).encode())
        os.close(fd)
    all_max(torch.zeros(1, device=device), WORLD)  # every rank passes it after rank 0's write
    seen = probe.is_file() and not probe.is_symlink() and probe.read_text() == str(nonce)
    missing = all_max(torch.tensor([0.0 if seen else 1.0], device=device), WORLD)
    if rank == 0:
        probe.unlink()
    if missing.item():
        here = "this rank sees it" if seen else f"this rank (host {socket.gethostname()}) does not"
        raise SpecError([("checkpoint.dir", f"{root!r} is not one directory for every rank: rank "
                          f"0 wrote {probe.name} into it and at least one rank cannot read it "
                          f"({here}). Checkpoints need a directory every node shares (a network "
                          "or cluster file system mounted at the same path on every host)")])
