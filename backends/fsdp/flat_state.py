"""FSDP1's portable state written and read in place, O(model / N) per rank, the way ZeRO's flat
partitions are (backends/deepspeed/checkpoint/fragments.py): each rank's shard of a unit's
FlatParameter holds a contiguous range of the flattened unit, so each original parameter's part of
it is a contiguous range of that parameter, written as chunks of the full tensor
(parallel/checkpoint/state/chunks.py).

Why not torch's `get_state_dict` / `set_state_dict` (what FSDP2 uses, and what FSDP1 used before):
for FSDP1 they build a ShardedTensor per parameter and unflatten the optimizer's flat state through
collectives, in Python. Measured on a 56M Llama at 2 ranks: 1.6-1.8 s of a 3.49 s save and 2.0-2.4 s of
a 5.23 s load, the save reaching 37% of the disk's direct write (docs/bench.md). Here a save builds
views and nothing else, and a load reads straight into the shards the optimizer steps.

The files are the portable layout every backend writes (same keys, whole-tensor chunks, the Adam
step once per parameter), so FSDP1 checkpoints and every other backend's read each other, at any
world size. `state_dict: full` keeps torch's path (rank 0 writes whole tensors).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from parallel.checkpoint.state import optim_state
from parallel.checkpoint.state import portable as ps
from parallel.checkpoint.state.chunks import FlatRange, Kept
from parallel.kits.names import clean_name


class Member(NamedTuple):
    """One original parameter of a unit's FlatParameter, as this rank's shard holds it: elements
    [start, start + numel) of the flattened parameter, at `offset` in the shard."""

    name: str
    shape: torch.Size
    offset: int
    numel: int
    start: int


def units(model) -> list[tuple[torch.Tensor, list[Member]]]:
    """(FlatParameter, its members) of every FSDP1 unit that holds parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out = []
    for path, unit in model.named_modules():
        handle = getattr(unit, "_handle", None) if isinstance(unit, FSDP) else None
        if handle is None:
            continue
        flat, prefix = handle.flat_param, clean_name(path + ".") if path else ""
        members = []
        for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
            part = ((info.offset_in_shard, info.numel_in_shard, info.intra_param_start_idx)
                    if info.in_shard else (0, 0, 0))
            members.append(Member(clean_name(prefix + fqn), torch.Size(shape), *part))
        out.append((flat, members))
    return out


def _local(flat) -> torch.Tensor:
    """The rank's shard, which FSDP reshards back to and the optimizer steps (flat.data only
    between forward and backward of a unit that is not resharded after forward). FSDP1 names it
    `_local_shard` at its first forward (lazy init); until then the flat parameter is the shard."""
    return getattr(flat, "_local_shard", flat).detach()


def persistent_buffers(model) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by portable name, live. FSDP1's module.state_dict() would
    all-gather every parameter first (its default FULL_STATE_DICT hooks): this reads the modules."""
    out = {}
    for path, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out.setdefault(clean_name(f"{path}.{name}" if path else name), buf)
    return out


def _tied(model_state: dict, tied: list[list[str]]) -> dict:
    """Tied weights under each of their names, as the module's state_dict() has them (FSDP1 holds
    a tied parameter once, under the name its walk met first)."""
    for group in tied:
        held = next((n for n in group if n in model_state), None)
        for name in group if held is not None else ():
            model_state[name] = model_state[held]
    return model_state


def _optimizer_members(optimizer, found) -> dict[int, tuple[torch.Tensor, list[Member]]]:
    """id(optimizer parameter) -> (its flat parameter, the members it holds): the FlatParameter
    itself (use_orig_params false), or each original parameter, a view of its part of the shard."""
    by_param = {}
    for flat, members in found:
        by_param[id(flat)] = (flat, members)
        for p, member in zip(getattr(flat, "_params", None) or (), members):
            by_param[id(p)] = (flat, [member])
    missing = sum(id(p) not in by_param for g in optimizer.param_groups for p in g["params"])
    if missing:
        raise ps.PortableStateError(f"fsdp1: {missing} optimizer parameter(s) are neither a "
                                    "unit's FlatParameter nor one of its original parameters; "
                                    "build the optimizer over the prepared model's parameters")
    return by_param


def _entries(entries: dict, p, flat, member: Member, reading: bool) -> dict:
    """One member's optimizer state: per-element entries as its range (views), scalars (Adam's
    step) once per parameter, by the rank holding its first element (every rank when reading)."""
    out = {}
    at = member.offset if p is flat else 0  # an original parameter's state is its own part only
    for key, value in entries.items():
        if torch.is_tensor(value) and value.dim() > 0:
            if value.shape != p.shape:
                raise ps.PortableStateError(
                    f"fsdp1: optimizer state {key!r} of {member.name} has shape "
                    f"{tuple(value.shape)}, not its parameter's {tuple(p.shape)}: only per-element "
                    "and scalar state maps to the portable layout; use state_dict: full")
            view = value.detach().view(-1)[at:at + member.numel]
            out[key] = FlatRange(view, member.start, member.shape)
        elif reading:
            out[key] = torch.zeros(())
        elif member.start == 0 and member.numel:
            out[key] = torch.as_tensor(value, dtype=torch.float32).clone()
    return out


def portable_state(model, optimizer, tied: list[list[str]], is_main: bool,
                   reading: bool = False) -> dict:
    """The portable state as views of this rank's shards (collective-free). `reading`: a load's
    template, every scalar a placeholder and every buffer a fresh tensor."""
    weights, state, names, _ = _layout(model, optimizer, reading)
    return _finish(model, optimizer, tied, is_main, reading, weights, state, names)


class LiveFlat:
    """portable_state's views (10-16 ms of a 27-44 ms async save at one 56M-Llama rank), kept for
    the next saves while each unit's shard, the optimizer's parameters and their state tensors are
    the same tensors over the same storage (`_identity`): a step updates them in place. Each save
    takes the scalars (Adam's step), the groups' hyper-parameters and the buffers anew. The engine
    clears it before a load."""

    def __init__(self):
        self.kept = Kept()
        self.clear = self.kept.clear

    def get(self, model, optimizer, tied: list[list[str]], is_main: bool) -> dict:
        weights, state, names, scalars = self.kept.get(_identity(model, optimizer),
                                                       lambda: (_layout(model, optimizer), True))
        state = {n: dict(entries) for n, entries in state.items()}
        for name, p, k in scalars:  # in place: the entries keep the optimizer's order
            state[name][k] = torch.as_tensor(optimizer.state[p][k], dtype=torch.float32).clone()
        return _finish(model, optimizer, tied, is_main, False, dict(weights), state,
                       [list(n) for n in names])


def _identity(model, optimizer) -> tuple:
    ptr = lambda t: (id(t), t.data_ptr())  # noqa: E731
    return (tuple((id(flat), _local(flat).data_ptr()) for flat, _ in units(model)),
            tuple(tuple(map(id, g["params"])) for g in optimizer.param_groups),
            tuple((id(p), tuple((k, ptr(v)) if torch.is_tensor(v) and v.dim() else k
                                for k, v in s.items())) for p, s in optimizer.state.items()))


def _layout(model, optimizer, reading: bool = False) -> tuple:
    """(weights, optimizer entries by name, each group's names, the (name, parameter, key) of
    every scalar entry): the views of this rank's shards."""
    found = units(model)
    weights = {m.name: FlatRange(_local(flat)[m.offset:m.offset + m.numel], m.start, m.shape)
               for flat, members in found for m in members}
    by_param = _optimizer_members(optimizer, found)
    state, names, scalars = {}, [], []
    for group in optimizer.param_groups:
        names.append([])
        for p in group["params"]:
            flat, members = by_param[id(p)]
            for member in members:
                names[-1].append(member.name)
                entries = _entries(optimizer.state.get(p, {}), p, flat, member, reading)
                state[member.name] = entries
                scalars += [(member.name, p, k) for k, v in entries.items() if torch.is_tensor(v)]
    return weights, state, names, scalars


def _finish(model, optimizer, tied, is_main: bool, reading: bool, weights: dict, state: dict,
            names: list[list[str]]) -> dict:
    groups = [{**optim_state.hyperparams(g), "params": n}
              for g, n in zip(optimizer.param_groups, names)]
    if reading:
        weights.update({k: torch.empty_like(v) for k, v in persistent_buffers(model).items()})
    elif is_main:  # buffers are never sharded: one rank writes them
        weights.update({k: v.detach().cpu() for k, v in persistent_buffers(model).items()})
    return {"model": _tied(weights, tied), "optim": {"state": state, "param_groups": groups}}


def save(sink, model, optimizer, tied: list[list[str]], is_main: bool,
         live: LiveFlat | None = None) -> None:
    ps.save_state((live or LiveFlat()).get(model, optimizer, tied, is_main), sink)


def load(path: Path, model, optimizer, tied: list[list[str]], weights_only: bool = False) -> None:
    """Read each rank's ranges into its shards and optimizer state in place, then the scalars,
    buffers and the groups' hyper-parameters (`weights_only`: the shards and buffers alone)."""
    reader = ps.open_state(path)
    if weights_only:  # no optimizer state created: a fresh optimizer stays fresh
        template = portable_state(model, optimizer, tied, is_main=False, reading=True)
        ps.load_state({"model": template["model"]}, path, reader=reader)
        _buffers_from(model, template["model"])
        drop_stale_unsharded(model)
        return
    optim_state.groups_template(path, reader)  # none stored: refused before anything changes
    optim_state.init_optimizer_state(optimizer)  # a fresh optimizer has no state to read into
    template = portable_state(model, optimizer, tied, is_main=False, reading=True)
    names = [g["params"] for g in template["optim"]["param_groups"]]
    # before anything is read in place: the same groups, or an error naming what moved
    merged = optim_state.merge_groups(optimizer.param_groups,
                                      optim_state.read_groups(path, reader), names)
    template["optim"]["param_groups"] = optim_state.groups_template(path, reader)
    ps.load_state(template, path, reader=reader)
    state = template["optim"]["state"]
    by_param = _optimizer_members(optimizer, units(model))
    for p in (p for g in optimizer.param_groups for p in g["params"]):
        group_names = [m.name for m in by_param[id(p)][1]]  # a FlatParameter holds several
        for key, old in optimizer.state.get(p, {}).items():
            if torch.is_tensor(old) and old.dim() > 0:
                continue
            value = optim_state.single_step({n: {"step": state[n][key]} for n in group_names
                                             if key in state[n]}, group_names)
            if value is not None:
                optimizer.state[p][key] = value.to(old) if torch.is_tensor(old) else type(old)(value)
    _buffers_from(model, template["model"])
    for group, new in zip(optimizer.param_groups, merged):
        group.update(new)
    drop_stale_unsharded(model)


def _buffers_from(model, read: dict) -> None:
    with torch.no_grad():
        for name, buf in persistent_buffers(model).items():
            buf.copy_(read[name])


def drop_stale_unsharded(model) -> None:
    """FSDP1 does not free the root unit's gathered parameters after forward (it expects backward
    next), and skips the all-gather when they are still there: after an evaluation's forward, the
    next forward would run on the values from before the load. Free them, as post-backward does."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        initialised = handle is not None and hasattr(handle.flat_param, "_local_shard")
        if initialised and handle.uses_sharded_strategy and not handle.needs_unshard():
            handle.reshard(True)
            handle.post_reshard()
