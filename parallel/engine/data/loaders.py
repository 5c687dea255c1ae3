"""The engine's data loaders: map-style and iterable datasets (Hugging Face `datasets`, streaming
too, or torch's), sharded by data-parallel rank, their position saved with the checkpoint by name.

Training loaders enter the checkpoint under a name (default `loader0`, `loader1`, ... in creation
order); evaluation loaders (`eval=True`) never do, so adding or dropping one does not change what
resume expects. Each training loader records a fingerprint of its dataset (length, and the Hugging
Face fingerprint where there is one); a resume whose dataset differs is refused naming both, unless
the loader was made with `accept_changed_data=True`.

Iterable datasets: a Hugging Face `IterableDataset` is split with `datasets.distributed.
split_dataset_by_node` (the library's own sharding: whole shards per rank when they divide, else
every world-th example) and its position is the dataset's own `state_dict` (datasets >= 2.18). A
torch `IterableDataset` is split every world-th sample, and resumed by skipping what was consumed
(its own `state_dict` is used instead where it has one).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping

from torch.utils.data import DataLoader, IterableDataset

from parallel.engine.data.resumable import DataChanged, ResumableLoader, ResumableSampler, check_same_data

__all__ = ["DataChanged", "Loaders", "build_loader", "plain_batch"]


def fingerprint(dataset) -> dict:
    out: dict = {"type": type(dataset).__name__}
    if not isinstance(dataset, IterableDataset) and hasattr(dataset, "__len__"):
        out["len"] = len(dataset)
    for attr in ("_fingerprint", "n_shards"):  # Hugging Face datasets
        value = getattr(dataset, attr, None)
        if isinstance(value, (str, int)):
            out[attr.lstrip("_")] = value
    return out


def _hf_iterable(dataset) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(dataset, datasets.IterableDataset)


class _EveryNth(IterableDataset):
    """A torch IterableDataset's share for one rank: samples rank, rank + n, ...; `skip` samples of
    this share already consumed (a resume)."""

    def __init__(self, dataset, n: int, rank: int):
        self.dataset, self.n, self.rank, self.skip = dataset, n, rank, 0

    def __iter__(self) -> Iterator:
        return itertools.islice(self.dataset, self.rank + self.skip * self.n, None, self.n)


class IterableLoader:
    """A DataLoader over an iterable dataset's per-rank share, counting batches as they are handed
    out; its position is the dataset's own state (Hugging Face) or samples consumed (torch)."""

    def __init__(self, loader, share, batch_size: int, print_: dict):
        self.loader, self.share, self.batch_size, self.fingerprint = loader, share, batch_size, print_
        self.epoch, self.batches_done = 0, 0
        self.accept_changed = False

    lockstep = None  # a stream's batches per rank are unknown: evaluate's ranks agree per batch

    def __iter__(self):
        for batch in self.loader:
            self.batches_done += 1
            yield batch
        self.epoch, self.batches_done = self.epoch + 1, 0
        if hasattr(self.share, "set_epoch"):  # Hugging Face: a new shuffle order per epoch
            self.share.set_epoch(self.epoch)
        if isinstance(self.share, _EveryNth):
            self.share.skip = 0

    def state_dict(self) -> dict:
        own = self.share.state_dict() if hasattr(self.share, "state_dict") else None
        return {"epoch": self.epoch, "batches_done": self.batches_done, "dataset_state": own,
                "batch_size": self.batch_size, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        check_same_data(state, self.fingerprint, self.accept_changed)
        self.epoch, self.batches_done = state["epoch"], state["batches_done"]
        if state.get("dataset_state") is not None and hasattr(self.share, "load_state_dict"):
            self.share.load_state_dict(state["dataset_state"])
        elif isinstance(self.share, _EveryNth):
            self.share.skip = self.batches_done * state["batch_size"]


def build_loader(dataset, *, size: int, dp_size: int, dp_rank: int, seed: int, shuffle: bool,
                 collate_fn: Callable | None, drop_last: bool, device_loader: Callable,
                 eval_: bool = False, pack=None, **torch_kwargs):
    """A resumable loader of `size`-sample batches of this rank's share of `dataset`. An eval
    loader reads every sample once (uneven shares) and starts each pass at its beginning.
    `pack` (packing.Packer): the items are documents, packed into rows: a map-style dataset's
    planned once, a stream's after the per-rank split."""
    stream = isinstance(dataset, IterableDataset) or _hf_iterable(dataset)
    if pack is not None and not stream:
        dataset = pack.rows(dataset)
    print_ = fingerprint(dataset)
    if stream:
        if torch_kwargs.get("num_workers", 0) > 0:
            raise ValueError(
                "engine.dataloader: num_workers > 0 with an iterable dataset: each worker would "
                "hold part of the stream's position, which the checkpoint cannot record exactly "
                "(torch's DataLoader keeps no state); use num_workers=0 (the stream is read in "
                "the training process), or a map-style dataset for parallel loading")
        if _hf_iterable(dataset):
            from datasets.distributed import split_dataset_by_node

            share = split_dataset_by_node(dataset, rank=dp_rank, world_size=dp_size)
        else:
            share = _EveryNth(dataset, dp_size, dp_rank)
        if pack is not None:
            share = pack.stream(share)
            print_["packed"] = share.n
        loader = DataLoader(share, batch_size=size, collate_fn=collate_fn, drop_last=drop_last,
                            **torch_kwargs)
        return IterableLoader(device_loader(loader), share, size, print_)
    if not hasattr(dataset, "__len__"):
        raise TypeError(f"engine.dataloader: {type(dataset).__name__} has neither __len__ (a "
                        "map-style dataset) nor __iter__ as a torch or Hugging Face "
                        "IterableDataset; wrap it in one of those")
    sampler = ResumableSampler(len(dataset), dp_size, dp_rank, seed, shuffle, even=not eval_)
    loader = DataLoader(dataset, batch_size=size, sampler=sampler, collate_fn=collate_fn,
                        drop_last=drop_last, **torch_kwargs)
    out = ResumableLoader(device_loader(loader), sampler, size, drop_last, rewinds=eval_)
    out.fingerprint = print_
    if eval_ and out.fewest_batches() == 0 < out.lockstep:
        # decided alike on every rank, here, rather than one rank failing inside evaluate() while
        # the others wait for it in a forward's gather
        raise ValueError(f"engine.dataloader: eval loader with drop_last=True over {len(dataset)} "
                         f"samples at {dp_size} ranks and batch_size {size}: the last rank gets no "
                         "batch; pass drop_last=False (the default for eval loaders) or a smaller "
                         "batch_size")
    return out


class Loaders:
    """The engine's loaders by name: training ones are saved and restored, evaluation ones never."""

    def __init__(self):
        self.train: dict[str, object] = {}
        self.eval: list = []

    def add(self, loader, name: str | None, eval_: bool, accept_changed: bool):
        loader.accept_changed = accept_changed
        if eval_:
            self.eval.append(loader)
            return loader
        name = name or f"loader{len(self.train)}"
        if name in self.train:
            raise ValueError(f"engine.dataloader: a training loader named {name!r} exists; pass "
                             "another name=")
        self.train[name] = loader
        return loader

    def __len__(self) -> int:
        return len(self.train)

    def state_dict(self) -> dict:
        return {name: loader.state_dict() for name, loader in self.train.items()}

    def load_state_dict(self, state, say: Callable[[str], None]) -> None:
        if isinstance(state, list):  # checkpoints before loaders had names: in creation order
            state = {f"loader{i}": s for i, s in enumerate(state)}
        for name, loader in self.train.items():
            if name in state:
                loader.load_state_dict(state[name])
            elif state:
                say(f"data loader {name!r} is not in the checkpoint (it has {sorted(state)}): "
                    "it starts at the beginning of its data")
        dropped = sorted(set(state) - set(self.train))
        if dropped:
            say(f"the checkpoint's data loader(s) {dropped} were not created in this run; their "
                "positions are not used")


def plain_batch(batch):
    """A Mapping that is not a dict (transformers' BatchEncoding, a UserDict) as a dict: the step
    splits and moves dicts and tuples."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        return dict(batch)
    return batch
