"""Optimizer state in the portable format, by parameter name: a torch optimizer's state and groups as
written (`optim_by_name`), read back into a live optimizer whose groups may differ in layout
(`merge_groups`, `optim_for_torch`), and the step counts flat layouts share (`shared_step`,
`single_step`). The tensors themselves go through portable.py like every other state."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from parallel.checkpoint.state.portable import (
    STATE_DIR,
    PortableStateError,
    SafeReader,
    dcp_load,
    open_state,
    stored_keys,
)

def hyperparams(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def groups_template(path: Path, reader: SafeReader | None = None) -> None:
    """Placeholder for the stored param_groups, read whole: which hyper-parameters a group holds
    depends on the optimizer that wrote it, not on this run's."""
    if "optim.param_groups" not in stored_keys(path, reader):
        raise PortableStateError(f"{path / STATE_DIR}: no optimizer state (optim.param_groups); "
                                 "load its weights alone with engine.load(path, weights_only=True), or "
                                 "resume from a training checkpoint")
    return None


def read_groups(path: Path, reader: SafeReader | None = None) -> list[dict]:
    """The stored param_groups alone (a small object; every rank reads it, no collective)."""
    reader = reader or open_state(path)
    groups_template(path, reader)
    template = {"optim": {"param_groups": None}}
    dcp_load(template, reader)
    return list(template["optim"]["param_groups"])


def merge_groups(live: list[dict], stored: list[dict], names: list[list[str]]) -> list[dict]:
    """This run's param_groups with every hyper-parameter it knows taken from the checkpoint (lr,
    betas, weight_decay, momentum, initial_lr...); its own `params` are kept. `names`: the parameter
    names of each live group. The groups must hold the same parameters as the checkpoint's: a
    parameter in another group would silently get another group's lr and decay."""
    if len(live) != len(stored):
        raise PortableStateError(f"the checkpoint's optimizer has {len(stored)} param groups, this "
                                 f"run's {len(live)}; build the optimizer with the same groups")
    where = {n: i for i, g in enumerate(stored) for n in g["params"]}
    moved = [(n, i, where.get(n)) for i, group in enumerate(names) for n in group
             if where.get(n) != i]
    if moved:
        text = ", ".join(f"{n} (group {i} here, {'none' if j is None else f'group {j}'} in the "
                         "checkpoint)" for n, i, j in moved[:3])
        raise PortableStateError(f"{len(moved)} parameter(s) sit in other param groups than in the "
                                 f"checkpoint: {text}; build the optimizer's groups as the run "
                                 "that wrote it did")
    return [{**group, **{k: v for k, v in saved.items() if k in group and k != "params"}}
            for group, saved in zip(live, stored)]


def shared_step(entries) -> torch.Tensor | None:
    """The one step count of optimizer entries that share a flat optimizer tensor (or a group)."""
    steps = {float(e["step"]) for e in entries if "step" in e}
    if len(steps) > 1:
        raise PortableStateError(f"entries that share one optimizer tensor disagree on the step "
                                 f"count: {sorted(steps)}")
    return torch.tensor(steps.pop()) if steps else None


def single_step(per_name: dict[str, dict], names) -> torch.Tensor | None:
    """The one step count shared by parameters that live in one flat optimizer tensor (this run's).
    A checkpoint with per-parameter counts that differ (a backend that skips parameters without a
    gradient, e.g. experts no rank used: parallel/engine/model/moe/experts.py) gives the most steps, which is
    what the flat tensor would have taken; the skipped parameters' Adam bias correction then uses
    it, as it would have on this backend all along (docs/moe.md)."""
    steps = {float(per_name[n]["step"]) for n in names if "step" in per_name.get(n, {})}
    if len(steps) > 1:
        warnings.warn(f"a flat optimizer tensor holds parameters whose step counts in the checkpoint "
                      f"differ ({sorted(steps)[:4]}, e.g. experts no rank used in some steps): it "
                      f"takes {max(steps):g}, the steps the flat tensor would have taken",
                      RuntimeWarning, stacklevel=2)
    return torch.tensor(max(steps)) if steps else None


def init_optimizer_state(optimizer: torch.optim.Optimizer, only: set[int] | None = None) -> None:
    """Create the optimizer's state for every parameter without any (`only`: those of these ids),
    by one step with zero gradients on those alone and lr 0, which changes no parameter for SGD,
    Adam and AdamW (decoupled decay is scaled by lr) and steps no other (torch's optimizers skip a
    parameter without a gradient). DCP and DeepSpeed's fragment links fill existing state only; a
    fresh optimizer has none until its first step, nor has a parameter that never had a gradient
    (an unused expert)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    fresh = {id(p) for p in params if not optimizer.state.get(p) and (only is None or id(p) in only)}
    # torch.optim.Muon on sharded matrices steps together with its peers (parallel/engine/model/
    # optim/muon.py), and ranks may lack state for different parameters: its one momentum is made
    # here and it is not stepped; the other members of several optimizers are
    members = getattr(optimizer, "members", [optimizer])
    for member in members:
        if isinstance(member, torch.optim.Muon):
            for p in (p for g in member.param_groups for p in g["params"] if id(p) in fresh):
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
                fresh.discard(id(p))
    if not fresh:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    grads = [p.grad for p in params]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p) if id(p) in fresh else None
    for member in members:
        if not isinstance(member, torch.optim.Muon):
            member.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    for p, g in zip(params, grads):
        p.grad = g


def optim_by_name(optimizer: torch.optim.Optimizer, name_of: dict[int, str]) -> dict:
    """A torch optimizer's state keyed by parameter name (`name_of`: id(param) -> name)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {"state": {name_of[id(p)]: dict(optimizer.state[p]) for p in params if optimizer.state.get(p)},
            "param_groups": [{**hyperparams(g), "params": [name_of[id(p)] for p in g["params"]]}
                             for g in optimizer.param_groups]}


def optim_for_torch(optimizer: torch.optim.Optimizer, state: dict, stored_groups: list[dict],
                    name_of: dict[int, str]) -> dict:
    """The inverse: a state dict `optimizer.load_state_dict` accepts (entries indexed by position),
    with this run's groups taking the checkpoint's hyper-parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    groups, index = [], 0
    for group in merge_groups(optimizer.param_groups, stored_groups, names):
        groups.append({**group, "params": list(range(index, index + len(group["params"])))})
        index += len(group["params"])
    return {"state": {i: state[name_of[id(p)]] for i, p in enumerate(params)
                      if name_of[id(p)] in state},
            "param_groups": groups}
