"""A distributed sampler and loader whose position survives a checkpoint.

Every rank draws the same permutation (seed + epoch) and takes every world_size-th index, like
DistributedSampler; the loader counts the batches it has handed out so a resumed run continues with
the next unseen batch instead of replaying or skipping data.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    def __init__(self, size: int, num_replicas: int, rank: int, seed: int, shuffle: bool = True):
        self.size, self.num_replicas, self.rank = size, num_replicas, rank
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.start = 0, 0
        if size < num_replicas:
            raise ValueError(f"dataset has {size} samples, fewer than the {num_replicas} ranks")

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return self.size // self.num_replicas - self.start

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=g).tolist()
        else:
            order = list(range(self.size))
        usable = self.size - self.size % self.num_replicas  # equal shares: no rank waits on another
        mine = order[:usable][self.rank::self.num_replicas]
        return iter(mine[self.start:])


class ResumableLoader:
    """Iterates a DataLoader over a ResumableSampler and records (epoch, batches handed out)."""

    def __init__(self, loader, sampler: ResumableSampler, batch_size: int):
        # `loader` iterates batches (a DataLoader, or a device loader wrapping one, e.g. XLA's
        # MpDeviceLoader); counting happens here, when a batch reaches the caller.
        self.loader, self.sampler, self.batch_size = loader, sampler, batch_size
        self.epoch, self.batches_done = 0, 0

    def __len__(self) -> int:
        per_rank = self.sampler.size // self.sampler.num_replicas
        return per_rank // self.batch_size - self.batches_done  # drop_last=True

    def __iter__(self):
        self.sampler.set_position(self.epoch, self.batches_done * self.batch_size)
        for batch in self.loader:
            self.batches_done += 1  # counted when handed out: a saved position includes this batch
            yield batch
        self.epoch, self.batches_done = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.batches_done,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state["batch_size"] != self.batch_size:
            raise ValueError(f"checkpoint's loader used batch_size {state['batch_size']}, this one "
                             f"{self.batch_size}; resume with the same batch size")
        self.epoch, self.batches_done = state["epoch"], state["batches_done"]
