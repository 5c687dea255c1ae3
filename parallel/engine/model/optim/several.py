"""Several optimizers in one job (a Muon recipe: Muon on the hidden matrices, AdamW on the rest), as
one torch optimizer, so that everything that takes one (the engine's step and clipping, GradScaler,
DeepSpeed's client optimizer, torch's `get_state_dict`, the portable checkpoint) takes them unchanged.

`Optimizers`' param_groups are its members' own group dicts, in order, and its members share its one
`state` dict: a scheduler or a load that changes a group's lr, or a step that fills a parameter's
state, is seen by the member and by the whole alike. A load replaces the group dicts (torch's
`load_state_dict` builds new ones), so it links them back. Each member keeps its own class, step and
defaults; `Schedulers` runs one LR schedule per member."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch


class Optimizers(torch.optim.Optimizer):
    """`members` stepped and zeroed together, in order; one state dict, one list of groups."""

    def __init__(self, members: list[torch.optim.Optimizer]):
        if not members or not all(isinstance(m, torch.optim.Optimizer) for m in members):
            raise TypeError("optimizer: a factory returning several optimizers must return a "
                            f"non-empty list of torch.optim.Optimizer, not {members!r}")
        self.members = list(members)
        # torch's own set-up (hooks, profiling names) over the members' group dicts, kept as they
        # are: add_param_group appends the dict itself and fills no default (defaults are empty)
        groups = [g for m in self.members for g in m.param_groups]
        super().__init__(groups, {})
        self.state = defaultdict(dict)
        for m in self.members:
            self.state.update(m.state)
        self._link()

    def _link(self) -> None:
        """Each member's groups as slices of this one's, each member's state this one's."""
        start = 0
        for m in self.members:
            m.param_groups = self.param_groups[start:start + len(m.param_groups)]
            m.state = self.state
            start += len(m.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for m in self.members:
            m.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.members:
            m.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts each state value by its group's options (a plain optimizer's "step" stays
        # on the CPU): the same groups as the members', so the same casts
        super().load_state_dict(state_dict)
        self._link()

    def __repr__(self) -> str:
        return f"Optimizers({', '.join(type(m).__name__ for m in self.members)})"


def members(optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers an engine's optimizer stands for: its members, or itself."""
    return list(optimizer.members) if isinstance(optimizer, Optimizers) else [optimizer]


def as_one(built) -> torch.optim.Optimizer:
    """What an optimizer factory returned, as one optimizer: a list or tuple becomes Optimizers."""
    return Optimizers(list(built)) if isinstance(built, (list, tuple)) else built


class Schedulers:
    """One LR schedule per member of Optimizers (the factory is called with each member, so it
    may build a different one per optimizer), stepped together and checkpointed as a list."""

    def __init__(self, factory: Callable, optimizer: Optimizers):
        self.schedulers = [factory(m) for m in optimizer.members]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        return [lr for s in self.schedulers for lr in s.get_last_lr()]

    def state_dict(self) -> dict:
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("schedulers") if isinstance(state, dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.schedulers):
            raise ValueError(f"scheduler: the checkpoint holds {_count(saved)} schedule(s), this "
                             f"run {len(self.schedulers)} (one per optimizer); build the "
                             "optimizers as the run that wrote it did")
        for s, one in zip(self.schedulers, saved):
            s.load_state_dict(one)


def _count(saved) -> str:
    return str(len(saved)) if isinstance(saved, list) else "one (a single optimizer's)"


def build_scheduler(factory: Callable, optimizer: torch.optim.Optimizer):
    """`prepare(scheduler=...)`: one schedule over the optimizer, or one per member."""
    return Schedulers(factory, optimizer) if isinstance(optimizer, Optimizers) else \
        factory(optimizer)
