"""The DeepSpeed adapter's checkpoint state: ZeRO's flat fp32 partitions and per-parameter masters to
and from the portable format (docs/checkpoint-format.md), through DeepSpeed's fragment API."""

from __future__ import annotations

from pathlib import Path

import torch

from parallel.checkpoint.state import optim_state
from parallel.checkpoint.state import portable as ps
from parallel.engine.model.params import aliases, tied_groups


def is_zero(optimizer) -> bool:
    """ZeRO-1/2 and the bf16 optimizer (bit16_groups), ZeRO-3 (sub-groups): flat fp32 partitions
    that DeepSpeed's fragment API maps back to each parameter."""
    return hasattr(optimizer, "bit16_groups") or hasattr(optimizer, "sub_group_to_group_id")


def master_names(ds) -> dict[int, str]:
    """id(fp32 master) -> parameter name, for optimizers that keep one fp32 copy per parameter."""
    opt = ds.optimizer
    if not hasattr(opt, "fp32_groups") or not hasattr(opt, "fp16_groups"):
        return {}
    if hasattr(opt, "fp32_groups_flat"):
        raise RuntimeError("deepspeed: ZeRO-0 fp16 with the fused FP16_Optimizer keeps flat fp32 "
                           "groups the portable checkpoint cannot map; use shard: optimizer (ZeRO-1)")
    names = {id(p): ps.clean_name(n) for n, p in ds.module.named_parameters()}
    return {id(m): names[id(p)] for lps, masters in zip(opt.fp16_groups, opt.fp32_groups)
            for p, m in zip(lps, masters)}


def _frozen(ds, trained: set[str]) -> dict:
    """Parameters the optimizer does not hold (requires_grad False), by name. ZeRO keeps no fp32
    master for them, but they are part of the model: the checkpoint holds them too."""
    return {n: p for n, p in ((ps.clean_name(n), p) for n, p in ds.module.named_parameters())
            if n not in trained}


def _whole(p) -> torch.Tensor:
    """A module parameter's full value on CPU (ZeRO-3 partitions it: gathered, one at a time)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
        return p.detach().cpu().clone()


def _with_aliases(ds, model: dict) -> dict:
    """Tied weights under each of their names, as the module's state_dict() has them."""
    for alias, canonical in aliases(tied_groups(ds.module)).items():
        if canonical in model:
            model[alias] = model[canonical]
    return model


def unfused_state(ds) -> dict:
    names, base = master_names(ds), ds.optimizer.optimizer
    model = {names[id(m)]: m.detach().cpu() for group in ds.optimizer.fp32_groups for m in group}
    model.update({n: _whole(p) for n, p in _frozen(ds, set(model)).items()})
    return {"model": _with_aliases(ds, {**model, **ps.buffers(ds.module)}),
            "optim": optim_state.optim_by_name(base, names)}


def plain_state(ds, optimizer) -> dict:
    """ZeRO-0 in fp32 under tensor parallelism: the client optimizer steps the module's own
    parameters, which AutoTP split (their TP shards, by name)."""
    names = {id(p): ps.clean_name(n) for n, p in ds.module.named_parameters()}
    model = {names[id(p)]: p.detach() for p in ds.module.parameters()}
    return {"model": _with_aliases(ds, {**model, **ps.buffers(ds.module)}),
            "optim": optim_state.optim_by_name(optimizer, names)}


def save_per_parameter(sink, state: dict, split, sharded: bool, is_main: bool) -> None:
    """State held whole on every data-parallel rank (ZeRO-0): written once by DCP; under tensor
    parallelism each rank's TP shards as blocks of the whole tensors, or (state_dict: full)
    gathered over the TP group and written by the main rank."""
    if split is None:
        ps.save_state(state, sink)
    elif sharded:
        ps.save_state(split.state(state, split.piece), sink)
    else:
        whole = split.state(state, split.whole)  # collective: every rank gathers
        if is_main:
            ps.save_state(whole, sink, collective=False)


def load_plain(ds, optimizer, path: Path, split, weights_only: bool = False) -> None:
    """plain_state's inverse: each rank reads its TP shards in place (`weights_only`: the model's
    alone, no optimizer state created)."""
    reader = ps.open_state(path)
    if weights_only:
        template = split.state({"model": plain_state(ds, optimizer)["model"]}, split.piece)
        ps.load_state(template, path, reader=reader)
        return
    optim_state.groups_template(path, reader)  # none stored: refused before state is made
    optim_state.init_optimizer_state(optimizer)
    names = {id(p): ps.clean_name(n) for n, p in ds.module.named_parameters()}
    live = plain_state(ds, optimizer)
    template = split.state(live, split.piece)
    template["optim"]["param_groups"] = optim_state.groups_template(path, reader)
    ps.load_state(template, path, reader=reader)  # into the parameters and the optimizer's tensors
    merged = optim_state.merge_groups(optimizer.param_groups, template["optim"]["param_groups"],
                             [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups])
    for group, new in zip(optimizer.param_groups, merged):
        group.update(new)


def load_unfused(ds, path: Path, split=None, weights_only: bool = False) -> None:
    """The fp32 masters (one per parameter), frozen parameters and buffers, then the model's
    weights from the masters, and (unless `weights_only`) the optimizer's state and groups."""
    names, base, reader = master_names(ds), ds.optimizer.optimizer, ps.open_state(path)
    if not weights_only:
        optim_state.groups_template(path, reader)  # none stored: refused before state is made
        optim_state.init_optimizer_state(base)
    masters = [m for group in ds.optimizer.fp32_groups for m in group]
    frozen = _frozen(ds, set(names.values()))
    template = {"model": _with_aliases(ds, {
                    **{names[id(m)]: m.detach().clone().cpu() for m in masters},
                    **{n: torch.empty(p.shape) for n, p in frozen.items()},
                    **{k: torch.empty_like(v) for k, v in ps.buffers(ds.module).items()}})}
    if not weights_only:
        template["optim"] = {"state": optim_state.optim_by_name(base, names)["state"],
                             "param_groups": optim_state.groups_template(path, reader)}
    reading = template if split is None else split.state(template, split.piece)  # in place
    ps.load_state(reading, path, reader=reader)
    for m in masters:
        m.data.copy_(template["model"][names[id(m)]])
    for n, p in frozen.items():
        p.data.copy_(template["model"][n])
    for lps, group in zip(ds.optimizer.fp16_groups, ds.optimizer.fp32_groups):  # masters -> model
        for p, m in zip(lps, group):
            p.data.copy_(m.data)
    ds.module.load_state_dict({k: template["model"][k] for k in ps.buffers(ds.module)}, strict=False)
    if weights_only:
        return
    base.load_state_dict(optim_state.optim_for_torch(base, template["optim"]["state"],
                                         reading["optim"]["param_groups"], names))


def partitions(zero) -> list[tuple[int, list, torch.Tensor]]:
    """(param group index, the model parameters, their flat fp32 partition on this rank)."""
    if hasattr(zero, "sub_group_to_group_id"):  # ZeRO-3 splits groups into sub-groups
        return [(zero.sub_group_to_group_id[i], lps, zero.fp32_partitioned_groups_flat[i])
                for i, lps in enumerate(zero.fp16_groups)]
    flats = getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_groups_flat_partition
    return [(i, lps, flat) for i, (lps, flat) in enumerate(zip(zero.bit16_groups, flats))]


def _flat_keys(base, flat) -> list[str]:
    state = base.state.get(flat, {})
    return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == flat.shape]


def _init_zero_state(zero) -> None:
    """Create optimizer state for each flat partition. ZeRO-3 hands its optimizer one sub-group at a
    time (param_groups' params are empty between steps), so each partition is stepped on its own."""
    base = zero.optimizer
    for group, _, flat in partitions(zero):
        if base.state.get(flat):
            continue
        params = base.param_groups[group]["params"]
        base.param_groups[group]["params"] = [flat]
        optim_state.init_optimizer_state(base)
        base.param_groups[group]["params"] = params


def relink(zero) -> None:
    """Point every parameter's optimizer-state fragment at its group's current state. DeepSpeed
    0.19.8's ZeRO-1/2 and bf16 optimizers link all groups once, right after group 0's first step,
    when later groups have no state yet: their fragments stay empty and the fragment API raises
    "exp_avg not found in optimizer state fragment" (docs/deepspeed.md). Relinking reads the state
    as it is now."""
    if hasattr(zero, "_hp_optimizer_states_linked"):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def zero_state(ds, mine, with_optimizer: bool = True, split=None) -> dict:
    """The portable state of a ZeRO engine gathered whole, one parameter at a time (DeepSpeed's
    fragment API over the data-parallel group, then AutoTP's shards over the TP group; collective),
    kept by the rank `mine(i)` picks: for `state_dict: full` (rank 0 writes everything) and
    gather_model(). Sharded saves write in place (fragments.py)."""
    whole = split.whole if split is not None else lambda name, t: t
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zero, names = ds.optimizer, {id(p): ps.clean_name(n) for n, p in ds.module.named_parameters()}
    base, i = zero.optimizer, 0
    relink(zero)
    model, state = {}, {}
    groups = [{**optim_state.hyperparams(g), "params": []} for g in base.param_groups]
    for group, lps, flat in partitions(zero):
        keys = _flat_keys(base, flat) if with_optimizer else []
        step = base.state.get(flat, {}).get("step") if with_optimizer else None
        for p in lps:
            groups[group]["params"].append(names[id(p)])
            weight = whole(names[id(p)], safe_get_full_fp32_param(p))
            entries = {k: whole(names[id(p)], safe_get_full_optimizer_state(p, k)) for k in keys}
            if mine(i):
                model[names[id(p)]] = weight.detach().cpu()
                state[names[id(p)]] = {k: v.detach().cpu() for k, v in entries.items()}
                if step is not None:
                    state[names[id(p)]]["step"] = torch.as_tensor(step, dtype=torch.float32).clone()
            i += 1
    for name, p in _frozen(ds, {n for g in groups for n in g["params"]}).items():
        value = whole(name, _whole(p))  # collective under ZeRO-3
        if mine(i):
            model[name] = value
        i += 1
    if mine(0):
        model.update(ps.buffers(ds.module))  # buffers are never partitioned
    return {"model": _with_aliases(ds, model), "optim": {"state": state, "param_groups": groups}}
