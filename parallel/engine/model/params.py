"""Parameters by name, across sharding: tied weights, and the optimizer's param groups.

Sharding replaces a model's parameters (FSDP2: DTensors; XLA: new tensors on the device; FSDP1: 1-D
views of a flat shard), so anything the user built from the model *as built* (param groups from
`named_parameters()`, grouping by `p.dim()`, tied weights) no longer points at what is trained.
polyshard knows every parameter's original name, so it maps by name:

- `ParamPlan(model)` runs before sharding: names, tied groups, weak references to the original
  parameters (nothing is kept alive), and a stand-in per parameter: a tensor with the parameter's shape,
  dtype and requires_grad as built, on the device the optimizer steps on, holding one element (an
  expanded view). FSDP1 turns every parameter into a 1-D view of a flat shard in place and ZeRO-3's
  zero.Init into an empty tensor, so the live objects no longer tell a factory what was built (measured:
  an AdamW factory splitting groups by `p.dim()` put every FSDP1 parameter in the no-decay group,
  2e-3 off by step 5);
- `ParamPlan.optimizer(...)` runs after: it calls the optimizer factory (or class) on the stand-ins
  (grouped by the `param_groups` hook's names if given), so it sees the model as built on every
  backend, then switches whatever the optimizer holds (stand-ins, or original parameters in groups built
  before `prepare`, the usual habit) to the sharded counterparts, and refuses an optimizer that does not
  hold every trainable parameter exactly once.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from parallel.kits.names import clean_name

ParamGroupsHook = Callable[[list[tuple[str, nn.Parameter]]], list[dict[str, Any]]]


class OptimizerMismatch(ValueError):
    """The optimizer does not hold the model's trainable parameters exactly once."""


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names that reach one parameter (tied weights), canonical (first) name first."""
    seen: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(clean_name(name))
    return [names for names in seen.values() if len(names) > 1]


def aliases(groups: list[list[str]]) -> dict[str, str]:
    """alias name -> canonical name, from tied_groups."""
    return {alias: names[0] for names in groups for alias in names[1:]}


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make every name of a tied group point at its canonical parameter again. `module.to(device)`
    unties weights whenever the device's tensors cannot share the CPU tensor's storage type (XLA:
    each module gets its own copy, measured 1.2e-3 to 3.9e-3 off by step 5 on GPT-2, T5, BERT);
    what transformers' tie_weights() does for its own models, for any model."""
    for canonical, *others in groups:
        param = model.get_parameter(canonical)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, param)


def per_parameter(model: nn.Module) -> list[tuple[nn.Parameter, list[str]]]:
    """Each parameter of a (maybe wrapped) model once, with the original name it holds: the
    `sharded` argument of ParamPlan.optimizer when sharding keeps one tensor per parameter."""
    return [(p, [clean_name(n)]) for n, p in model.named_parameters()]


Sharded = list[tuple[nn.Parameter, list[str]]]  # trained tensor, the original names it holds


def stand_in(p: torch.Tensor, device: torch.device | str = "cpu") -> nn.Parameter:
    """A parameter's shape (ZeRO-3's `ds_shape` when partitioned), dtype and requires_grad as built,
    holding one element: what optimizer factories and param_groups hooks are shown."""
    shape = tuple(getattr(p, "ds_shape", p.shape))
    one = torch.empty((), dtype=p.dtype, device=device)
    return nn.Parameter(one.expand(shape), requires_grad=p.requires_grad)


class ParamPlan:
    """What is known of the parameters before sharding, applied to the optimizer after it."""

    def __init__(self, model: nn.Module, hook: ParamGroupsHook | None = None,
                 device: torch.device | str = "cpu"):
        named = [(clean_name(n), p) for n, p in model.named_parameters()]
        self.tied = tied_groups(model)
        self._originals = {id(p): (weakref.ref(p), n) for n, p in named}
        self.trainable = {n for n, p in named if p.requires_grad}
        self.as_built = [(n, stand_in(p, device)) for n, p in named]  # kept: they are 1 element each
        self._originals.update({id(s): (weakref.ref(s), n) for n, s in self.as_built})
        # a hook may return the stand-ins it was shown or the model's own parameters
        name_of = {id(s): n for n, s in self.as_built} | {id(p): n for n, p in named}
        self.groups = _named_groups(hook(self.as_built), name_of) if hook else None
        self._stand_in = dict(self.as_built).__getitem__

    def restrict(self, held: set[str]) -> None:
        """Only `held` is on this rank (topology.pp: its stages): the optimizer is built over those
        names, each of the hook's groups kept (maybe empty) so that group i is group i on every
        stage (a scheduler's per-group rates)."""
        self.trainable &= held
        self.as_built = [(n, s) for n, s in self.as_built if n in held]
        if self.groups is not None:
            self.groups = [([n for n in names if n in held], hyper) for names, hyper in self.groups]

    def original_name(self, p) -> str | None:
        entry = self._originals.get(id(p))
        return entry[1] if entry is not None and entry[0]() is p else None

    def optimizer(self, build: Callable[[Any], Any], sharded: Sharded):
        """Build over the stand-ins of the hook's groups (by name) or of every trainable parameter,
        then switch() whatever the optimizer (or each of a list of them) holds onto the sharded
        tensors."""
        if self.groups is None:
            over = [s for n, s in self.as_built if n in self.trainable]
        else:
            over = [{**hyper, "params": [self._stand_in(n) for n in names]}
                    for names, hyper in self.groups]
        built = build(over)
        # several optimizers (a list): checked and switched as one, every member's groups in order
        whole = SimpleNamespace(param_groups=[g for m in built for g in m.param_groups]) \
            if isinstance(built, (list, tuple)) else built
        self.switch(whole, sharded)
        return built

    def switch(self, optimizer: torch.optim.Optimizer, sharded: Sharded) -> None:
        """Each optimizer group's entries as original names (a sharded tensor stands for the names
        it holds; an original parameter for its own), then back as sharded tensors. Refuses a tensor
        that is no parameter of the model, and an optimizer that does not hold every trainable
        parameter exactly once."""
        members = {id(p): names for p, names in sharded}
        per_group = []
        for i, group in enumerate(optimizer.param_groups):
            names = []
            for p in group["params"]:
                found = members.get(id(p)) or [self.original_name(p)]
                if found == [None]:
                    raise OptimizerMismatch(
                        f"optimizer: param group {i} holds a tensor of shape {tuple(p.shape)} that "
                        "is not a parameter of the model passed to prepare(); build the optimizer "
                        "from that model's parameters")
                names += found
            per_group.append(names)
        held: dict[str, int] = {}
        for names in per_group:
            for n in names:
                held[n] = held.get(n, 0) + 1
        _check_held(held, self.trainable)
        for group, tensors in zip(optimizer.param_groups, _regroup(per_group, sharded)):
            group["params"] = tensors


def _regroup(groups: list[list[str]], sharded: Sharded) -> list[list[nn.Parameter]]:
    """Groups of original names -> groups of the sharded tensors holding them. A flat tensor holds
    several parameters (XLA FSDP v1, FSDP1 without use_orig_params): they must share a group."""
    owner = {n: (i, p) for i, (p, names) in enumerate(sharded) for n in names}
    out, group_of = [], {}
    for g, names in enumerate(groups):
        tensors = []
        for n in names:
            if n not in owner:
                raise OptimizerMismatch(f"optimizer: {n} is not trained by this backend's sharded "
                                        "model (a frozen or removed parameter?)")
            i, p = owner[n]
            if group_of.setdefault(i, g) != g:
                together = sharded[i][1]
                raise OptimizerMismatch(
                    f"optimizer: {together[:4]} are one flat tensor on this backend (XLA FSDP v1 "
                    "flatten_parameters, or FSDP1 without use_orig_params) but sit in param groups "
                    f"{group_of[i]} and {g}; keep a unit's parameters in one group, or set "
                    "xla.flatten_parameters: false / fsdp.use_orig_params: true")
            if not any(t is p for t in tensors):
                tensors.append(p)
        out.append(tensors)
    return out


def _check_held(held: dict[str, int], trainable: set[str]) -> None:
    twice = sorted(n for n, k in held.items() if k > 1)
    missing = sorted(trainable - set(held))
    if twice:
        raise OptimizerMismatch(f"optimizer: {twice[:5]} appear in more than one place of its "
                                "param groups; put each parameter in exactly one group")
    if missing:
        raise OptimizerMismatch(
            f"optimizer: holds no entry for {len(missing)} trainable parameter(s), e.g. "
            f"{missing[:5]}: they would get gradients and never be updated. Add them to a param "
            "group, or freeze them with requires_grad_(False) before prepare()")


def _named_groups(groups: list[dict], name_of: dict[int, str]) -> list[tuple[list[str], dict]]:
    """The hook's groups with every entry as a name (it may give names or parameters)."""
    out, known = [], set(name_of.values())
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise OptimizerMismatch(f"param_groups: entry {i} must be a dict with 'params' (names "
                                    "or parameters) and optional hyper-parameters, like a torch "
                                    "optimizer's param group")
        names = []
        for p in group["params"]:
            name = p if isinstance(p, str) else name_of.get(id(p))
            if name not in known:
                what = repr(p) if isinstance(p, str) else f"a tensor of shape {tuple(p.shape)}"
                raise OptimizerMismatch(f"param_groups: group {i} holds {what}, which is not a "
                                        "parameter of the model passed to prepare()")
            names.append(name)
        out.append((names, {k: v for k, v in group.items() if k != "params"}))
    return out
