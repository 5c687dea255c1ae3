"""A distributed sampler and loader whose position survives a checkpoint.

Every rank draws the same permutation (seed + epoch) and takes every world_size-th index, like
DistributedSampler. The position is kept as global samples consumed this epoch: the permutation's
first `consumed` entries are exactly what every rank has seen together, so a run resumed on another
world size (or batch size) continues with the next unseen samples instead of replaying or skipping.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    def __init__(self, size: int, num_replicas: int, rank: int, seed: int, shuffle: bool = True,
                 even: bool = True):
        self.size, self.num_replicas, self.rank = size, num_replicas, rank
        # even: equal shares, the remainder left for the next epoch (training: every rank steps
        # alike). Not even (evaluation): every sample once, the first size % n ranks one more.
        self.seed, self.shuffle, self.even = seed, shuffle, even
        self.epoch, self.start = 0, 0
        if size < num_replicas:
            raise ValueError(f"dataset has {size} samples, fewer than the {num_replicas} ranks")

    def set_position(self, epoch: int, start: int) -> None:
        """`start`: global samples (over all ranks) already consumed in `epoch`."""
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        rest = self.size - self.start
        if self.even:
            return rest // self.num_replicas
        return rest // self.num_replicas + (self.rank < rest % self.num_replicas)

    def share(self, rank: int) -> int:
        """Samples `rank` reads in a whole epoch."""
        extra = 0 if self.even else rank < self.size % self.num_replicas
        return self.size // self.num_replicas + extra

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=g).tolist()
        else:
            order = list(range(self.size))
        rest = order[self.start:]
        if self.even:  # equal shares: no rank waits on another
            rest = rest[:len(rest) - len(rest) % self.num_replicas]
        return iter(rest[self.rank::self.num_replicas])


class DataChanged(ValueError):
    """The checkpoint's dataset is not this run's (another length or fingerprint)."""


def check_same_data(state: dict, mine: dict, accept: bool) -> None:
    theirs = state.get("fingerprint")
    if theirs is None or theirs == mine or accept:
        return
    raise DataChanged(f"the checkpoint's data loader read another dataset ({theirs}) than this "
                      f"run's ({mine}), so its saved position points into different data; resume "
                      "with the same dataset, or pass accept_changed_data=True to "
                      "engine.dataloader() to continue from that position anyway")


class ResumableLoader:
    """Iterates a DataLoader over a ResumableSampler and records (epoch, batches handed out)."""

    def __init__(self, loader, sampler: ResumableSampler, batch_size: int, drop_last: bool = True,
                 rewinds: bool = False):
        # `loader` iterates batches (a DataLoader, or a device loader wrapping one, e.g. XLA's
        # MpDeviceLoader); counting happens here, when a batch reaches the caller.
        self.loader, self.sampler, self.batch_size = loader, sampler, batch_size
        # rewinds: every pass starts at the beginning (an eval loader: never resumed, and a pass cut
        # short by evaluate(max_batches=) must not make the next pass start in the middle)
        self.drop_last, self.rewinds = drop_last, rewinds
        self.epoch, self.batches_done = 0, 0
        self.fingerprint: dict | None = None  # the dataset's (loaders.fingerprint)
        self.accept_changed = False

    @property
    def samples_done(self) -> int:
        return self.batches_done * self.batch_size * self.sampler.num_replicas

    def _batches(self, share: int) -> int:
        return share // self.batch_size if self.drop_last else -(-share // self.batch_size)

    def __len__(self) -> int:
        return self._batches(self.sampler.share(self.sampler.rank)) - self.batches_done

    @property
    def lockstep(self) -> int:
        """The most batches any rank has left in this pass (rank 0's: it gets the extra sample of an
        uneven split), known on every rank: evaluation runs that many forwards on each, with no
        collective (evaluate.py)."""
        return self._batches(self.sampler.share(0)) - (0 if self.rewinds else self.batches_done)

    def fewest_batches(self) -> int:
        """The fewest batches a rank gets in a whole pass (the last rank's)."""
        return self._batches(self.sampler.share(self.sampler.num_replicas - 1))

    def __iter__(self):
        if self.rewinds:
            self.batches_done = 0
        self.sampler.set_position(self.epoch, self.samples_done)
        for batch in self.loader:
            self.batches_done += 1  # counted when handed out: a saved position includes this batch
            yield batch
        self.epoch, self.batches_done = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "samples_done": self.samples_done,
                "batch_size": self.batch_size, "world_size": self.sampler.num_replicas,
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        check_same_data(state, self.fingerprint, self.accept_changed)
        step_samples = self.batch_size * self.sampler.num_replicas
        if state["samples_done"] % step_samples:
            raise ValueError(
                f"checkpoint's loader had consumed {state['samples_done']} samples (batch_size "
                f"{state['batch_size']} x {state['world_size']} ranks); this run takes "
                f"{step_samples} per batch, which does not divide it, so the next batch would "
                "straddle seen and unseen samples; keep the global batch a divisor of that count")
        self.epoch, self.batches_done = state["epoch"], state["samples_done"] // step_samples
