"""ZeRO checkpoints in O(model / N) per rank: each rank saves and loads, in place, the ranges of each
parameter its flat fp32 partition holds (docs/checkpoint-format.md, "Memory per rank").

ZeRO-1/2 (and the bf16 optimizer) keep each parameter group as one flat fp32 tensor split evenly over
the ranks; DeepSpeed's `_hp_mapping` says which contiguous range [start, start + n) of a parameter's
flattened view lands in this rank's partition, and gives views of the fp32 master and of each
optimizer entry over it. ZeRO-3 partitions each parameter on its own: rank r holds elements
[r * p, (r + 1) * p) of it, p = its partition size, at `grad_position` in its sub-group's flat fp32
tensor. Either way the range is written as chunks of the full tensor (parallel/checkpoint/state/chunks.py):
no rank gathers a parameter, and any backend at any world size reads the result. `LiveShards` keeps
a save's views for the next saves while they are live.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from parallel.checkpoint.state import optim_state
from parallel.checkpoint.state import portable as ps
from parallel.checkpoint.state.chunks import FlatRange, Kept
from parallel.engine.model.params import aliases, tied_groups

from backends.deepspeed.checkpoint.state import (_flat_keys, _frozen, _init_zero_state, _with_aliases,
                                                 partitions, relink)


def _ranges(zero, p, flat, keys: list[str], box=None) -> tuple[FlatRange, dict[str, FlatRange]]:
    """This rank's range of parameter `p`: its fp32 master and each optimizer entry, as views
    (`box`: where AutoTP's shard, which the range is of, sits in the whole tensor)."""
    if hasattr(p, "ds_id"):  # ZeRO-3: this rank's slice of the parameter, padding dropped
        _, offset, _ = zero.grad_position[zero.get_param_id(p)]
        size, rank = p.partition_numel(), dist.get_rank(group=zero.dp_process_group)
        start = rank * size
        n = max(0, min(size, p.ds_numel - start))
        shape = p.ds_shape
        master = flat.narrow(0, offset, n)
        entries = {k: zero.optimizer.state[flat][k].narrow(0, offset, n) for k in keys}
    else:
        mapping, shape = p._hp_mapping, p.shape
        if mapping is None:  # none of this parameter is in this rank's partition
            start, empty = 0, flat.new_empty(0)
            return (FlatRange(empty, 0, shape, box),
                    {k: FlatRange(empty, 0, shape, box) for k in keys})
        start = mapping.lp_fragment_address.start
        master = mapping.hp_fragment.view(-1)
        entries = {k: mapping.get_optim_state_fragment(k).view(-1) for k in keys}
    return (FlatRange(master.detach(), start, shape, box),
            {k: FlatRange(v.detach(), start, shape, box) for k, v in entries.items()})


def _frozen_part(p, dp_rank: int, box=None):
    """A frozen parameter as this rank holds it: ZeRO-3 partitions it over the data-parallel
    group (this rank's slice of `ds_tensor`); ZeRO-1/2 keep it whole on every rank (`box`: where
    AutoTP's shard of it sits in the whole tensor)."""
    if hasattr(p, "ds_id"):
        size = p.partition_numel()
        start = dp_rank * size
        n = max(0, min(size, p.ds_numel - start))
        return FlatRange(p.ds_tensor.data.view(-1)[:n], start, p.ds_shape, box)
    return p.data if box is None else FlatRange(p.data.view(-1), 0, p.shape, box)


def sharded_state(ds, split=None, live: LiveShards | None = None) -> dict:
    """The portable state of a ZeRO engine, each rank holding views of only what it owns. Under
    tensor parallelism each TP rank's data-parallel group partitions its own shards (written as
    blocks of the whole tensors); what AutoTP left whole is the same on every TP rank and written
    by the first. `live`: the views kept from an earlier save while they still are live."""
    return (live or LiveShards()).get(ds, split)


class LiveShards:
    """sharded_state's views (1,125 FlatRanges for a 56M Llama under ZeRO-3: 12-26 ms of an async
    save's 47-56 ms blocking at one rank), kept for the next saves while ZeRO's flat partitions,
    their optimizer state and the module's parameters (ZeRO-3: their partitions) and buffers are the
    same tensors over the same storage (`_identity`): a step updates them in place. Each save takes
    the step counts, the groups' hyper-parameters and the buffers anew. The engine clears it before
    a load."""

    def __init__(self):
        self.kept = Kept()
        self.clear = self.kept.clear

    def get(self, ds, split=None) -> dict:
        model, state, names, steps, alias = self.kept.get(_identity(ds),
                                                          lambda: (_layout(ds, split), True))
        base = ds.optimizer.optimizer
        model, state = dict(model), {n: dict(entries) for n, entries in state.items()}
        for name, flat in steps:  # one scalar per parameter, by the rank holding its first element
            state[name]["step"] = torch.as_tensor(base.state[flat]["step"], dtype=torch.float32).clone()
        if dist.get_rank() == 0:
            model.update(ps.buffers(ds.module))  # buffers are never partitioned
        model.update({a: model[c] for a, c in alias.items() if c in model})  # tied: every name
        groups = [{**optim_state.hyperparams(g), "params": list(n)}
                  for g, n in zip(base.param_groups, names)]
        return {"model": model, "optim": {"state": state, "param_groups": groups}}


def _identity(ds) -> tuple:
    zero = ds.optimizer
    flats = [flat for _, _, flat in partitions(zero)]
    state = [zero.optimizer.state.get(flat, {}) for flat in flats]
    ptr = lambda t: (id(t), t.data_ptr())  # noqa: E731
    return (tuple(map(ptr, flats)),
            tuple(tuple((k, ptr(v)) if torch.is_tensor(v) else k for k, v in s.items())
                  for s in state),
            tuple(ptr(getattr(p, "ds_tensor", p)) for p in ds.module.parameters()),
            tuple(map(ptr, ds.module.buffers())))


def _layout(ds, split) -> tuple:
    """(model views, optimizer views by name, each group's names, the (name, flat) whose step this
    rank writes, tied aliases): what sharded_state keeps."""
    zero = ds.optimizer
    base = zero.optimizer
    boxes, tp_rank = (split.boxes, split.rank) if split else ({}, 0)
    dp, dp_rank = dist.get_world_size(zero.dp_process_group), dist.get_rank(zero.dp_process_group)
    names = {id(p): ps.clean_name(n) for n, p in ds.module.named_parameters()}
    relink(zero)
    model, state, steps = {}, {}, []
    groups: list[list[str]] = [[] for _ in base.param_groups]
    for group, lps, flat in partitions(zero):
        keys, step = _flat_keys(base, flat), base.state.get(flat, {}).get("step")
        for p in lps:
            name = names[id(p)]
            groups[group].append(name)
            if tp_rank and name not in boxes:  # whole on every TP rank: the first writes it
                continue
            model[name], state[name] = _ranges(zero, p, flat, keys, boxes.get(name))
            first = model[name].start == 0 and not any(boxes[name].origin if name in boxes else ())
            if step is not None and first and model[name].data.numel():
                steps.append((name, flat))
    trained = {n for g in groups for n in g}
    for i, (name, p) in enumerate(_frozen(ds, trained).items()):
        if tp_rank and name not in boxes:  # whole on every TP rank: the first writes it
            continue
        if hasattr(p, "ds_id") or i % dp == dp_rank:  # ZeRO-1/2 hold it whole: round robin
            model[name] = _frozen_part(p, dp_rank, boxes.get(name))
    return model, state, groups, steps, aliases(tied_groups(ds.module))


def load_sharded(ds, path: Path, split=None, weights_only: bool = False) -> None:
    """Read each rank's ranges in place: fp32 masters and optimizer entries, then the model's
    weights from the masters (ZeRO-1/2: DeepSpeed's own all-gather of the partitions; ZeRO-3: each
    rank's slice), the shared step counts and the groups' hyper-parameters. `weights_only`: the
    masters, frozen parameters and buffers alone; no optimizer state created or linked (a link
    made over no state would stay empty after DeepSpeed's first step)."""
    zero, reader = ds.optimizer, ps.open_state(path)
    base = zero.optimizer
    if not weights_only:
        optim_state.groups_template(path, reader)  # none stored: refused before state is made
        _init_zero_state(zero)  # a fresh optimizer has no state for the ranges to point at
        relink(zero)
    model, state, members = _read_template(ds, split, weights_only)
    buffers = ps.buffers(ds.module)
    template, merged = {"model": _with_aliases(ds, model)}, []
    if not weights_only:
        template["optim"] = {"state": state,
                             "param_groups": optim_state.groups_template(path, reader)}
        live = [[] for _ in base.param_groups]  # ZeRO-3's sub-groups collapse into their group
        for group, _, group_names in members:
            live[group] += group_names
        # before anything is read in place: the same groups, or an error naming what moved
        merged = optim_state.merge_groups(base.param_groups, optim_state.read_groups(path, reader),
                                          live)
    if hasattr(zero, "checkpoint_event_prologue"):  # ZeRO-3: release what forward left gathered
        zero.checkpoint_event_prologue()
    ps.load_state(template, path, reader=reader)
    ds.module.load_state_dict({k: model[k] for k in buffers}, strict=False)
    for _, flat, group_names in members:  # no step read under weights_only: nothing to set
        step = optim_state.single_step(state, group_names)
        if step is not None and "step" in base.state.get(flat, {}):
            old = base.state[flat]["step"]
            base.state[flat]["step"] = step.to(old) if torch.is_tensor(old) else type(old)(step)
    for group, new in zip(base.param_groups, merged):
        group.update(new)
    _masters_to_model(zero)


def _read_template(ds, split, weights_only: bool) -> tuple[dict, dict, list]:
    """A load's views: (model ranges by name, buffers as fresh tensors included; optimizer
    entries by name; each partition's (group, flat, names))."""
    zero = ds.optimizer
    base, dp_rank = zero.optimizer, dist.get_rank(zero.dp_process_group)
    boxes = split.boxes if split else {}
    names = {id(p): ps.clean_name(n) for n, p in ds.module.named_parameters()}
    model, state, members = {}, {}, []
    for group, lps, flat in partitions(zero):
        keys = [] if weights_only else _flat_keys(base, flat)
        members.append((group, flat, [names[id(p)] for p in lps]))
        for p in lps:
            name = names[id(p)]
            model[name], state[name] = _ranges(zero, p, flat, keys, boxes.get(name))
            if "step" in base.state.get(flat, {}) and not weights_only:
                state[name]["step"] = torch.zeros(())
    trained = set(model)
    for name, p in _frozen(ds, trained).items():
        model[name] = _frozen_part(p, dp_rank, boxes.get(name))  # every rank reads what it holds
    model.update({k: torch.empty_like(v) for k, v in ps.buffers(ds.module).items()})
    return model, state, members


def _masters_to_model(zero) -> None:
    """The model's (maybe bf16) weights from the fp32 masters just read."""
    if hasattr(zero, "sub_group_to_group_id"):  # ZeRO-3: each rank's slices, no communication
        for i in range(len(zero.fp16_groups)):
            zero._reassign_or_swap_out_partitioned_parameters(i)
        # then what DeepSpeed's own load ends with: persistent parameters (below
        # param_persistence_threshold) are held whole on every rank and never gathered again by
        # forward: gathered from the slices just read. Without it a load into an engine that had
        # trained ran its next steps on the old small parameters (norms): 2.9e-3 off by step 5.
        zero.checkpoint_event_epilogue()
    else:  # ZeRO-1/2, bf16: copy this rank's partition in, all-gather the flat groups
        zero.update_lp_params()
