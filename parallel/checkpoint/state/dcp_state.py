"""Portable state (parallel/checkpoint/state/portable.py) for modules torch's `get_state_dict` understands:
plain modules, FSDP1 and FSDP2. It strips wrapper prefixes (`_fsdp_wrapped_module`,
`_checkpoint_wrapped_module`) and keys optimizer state by parameter name, which is exactly the
portable layout. `LiveState` hands its sharded state out again while it still is the live state."""

from __future__ import annotations

from itertools import chain
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from parallel.checkpoint.state.chunks import Kept
from parallel.checkpoint.state.optim_state import groups_template, init_optimizer_state, merge_groups
from parallel.checkpoint.state.portable import (
    entry_of,
    load_state,
    open_state,
    save_state,
    stored_keys,
)
from parallel.checkpoint.state.sink import Sink


def write_model_optim(sink: Sink, model, optimizer, sharded: bool, rank: int,
                      on_cpu: bool = False, live: LiveState | None = None,
                      splits: tuple = ()) -> None:
    """`splits`: the engine's parts that leave this rank part of the model (pipeline stages, ep's
    experts; each has `whole_groups(names per group)`, every rank's names of each group): the
    stored groups name the whole model's parameters."""
    if sharded:  # every rank writes its own shards (DTensor / ShardedTensor chunks)
        msd, osd = (live or LiveState()).get(model, optimizer)
        if splits:
            names = [list(g["params"]) for g in osd["param_groups"]]
            for split in splits:  # the experts over ep first, then the stages over pp
                names = split.whole_groups(names)
            osd = {**osd, "param_groups": [{**g, "params": n}
                                           for g, n in zip(osd["param_groups"], names)]}
        save_state({"model": msd, "optim": osd}, sink)
        return
    # Full: the state is gathered and rank 0 writes whole tensors. On accelerators it is gathered
    # onto rank 0's CPU only (cpu_offload). On a CPU device torch 2.9's FSDP1 segfaults in that path
    # (measured, docs/fsdp.md) and the tensors are in CPU memory anyway, so every rank gathers.
    options = StateDictOptions(full_state_dict=True, cpu_offload=not on_cpu)
    msd, osd = get_state_dict(model, optimizer, options=options)
    if rank == 0:
        save_state({"model": msd, "optim": osd}, sink, collective=False)


def read_model_optim(path: Path, model, optimizer, weights_only: bool = False,
                     splits: tuple = ()) -> None:
    # The templates come from this run's own sharding: DCP reshards into them, whatever world size
    # or backend wrote the files. get_state_dict also creates optimizer state that does not exist
    # yet, so a weights-only load asks for the model's alone: the optimizer stays as it is.
    # `splits`' elsewhere: the model's entries other ranks hold (other stages, other ep ranks').
    elsewhere = frozenset().union(*(split.elsewhere for split in splits))
    reader = open_state(path)
    if weights_only:
        msd = get_model_state_dict(model)
        load_state({"model": msd}, path, reader=reader, elsewhere=elsewhere)
        set_model_state_dict(model, msd)
        return
    groups_template(path, reader)  # none stored: refused before get_state_dict creates state
    stored = {entry_of(k) for k in stored_keys(path, reader) if k.startswith("optim.state.")}
    msd, osd = get_state_dict(model, optimizer)
    # A parameter that has had no gradient yet (an expert no rank used) has no optimizer state:
    # where the checkpoint has some, it is made here to be filled; where the checkpoint has none
    # (none then), the live state is dropped, as the run that wrote it had none.
    lacking = {id(p) for group, named in zip(optimizer.param_groups, osd["param_groups"])
               for p, name in zip(group["params"], named["params"])
               if name in stored and not optimizer.state.get(p)}
    if lacking:
        init_optimizer_state(optimizer, only=lacking)
        msd, osd = get_state_dict(model, optimizer)
    template = {"model": msd, "optim": {"state": {n: v for n, v in osd["state"].items()
                                                  if n in stored},
                                        "param_groups": groups_template(path, reader)}}
    load_state(template, path, reader=reader, elsewhere=elsewhere)
    groups = merge_groups(osd["param_groups"], template["optim"]["param_groups"],
                          [g["params"] for g in osd["param_groups"]])
    set_state_dict(model, optimizer, model_state_dict=template["model"],
                   optim_state_dict={"state": template["optim"]["state"], "param_groups": groups})


class LiveState:
    """get_state_dict's sharded (model, optimizer) state, reused by the next saves while it is still
    the live state: its model values are detached views of the parameters and buffers, and its
    optimizer state is the optimizer's own per-parameter dicts, so a step updates both in place.
    torch recomputes it at every call: 18-33 ms of an async save's 31-57 ms at one 56M-Llama rank
    (225 names resolved, 150 DTensors detached again), the step's largest share of the blocking.

    Reused only while the same parameter and buffer tensors sit over the same storage and the groups
    hold the same parameters (`_identity`), every model value is a tensor over live storage (no
    extra_state objects) and the optimizer has torch's own `state_dict` without hooks. Each reuse
    reads the optimizer's state dicts and hyper-parameters (a scheduler's lr) anew. The owner clears
    it before a load, which may replace the parameters it holds views of."""

    def __init__(self):
        self.kept = Kept()
        self.clear = self.kept.clear

    def get(self, model, optimizer) -> tuple[dict, dict]:
        msd, osd, fqn, names = self.kept.get(_identity(model, optimizer),
                                             lambda: _layout(model, optimizer))
        if fqn is None:  # not reusable: torch's own, computed at this save
            return msd, osd
        state = {fqn[id(p)]: s for p, s in optimizer.state.items()}  # the optimizer's order
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(n)}
                  for g, n in zip(optimizer.param_groups, names)]
        return dict(msd), {"state": state, "param_groups": groups}


def _layout(model, optimizer) -> tuple[tuple, bool]:
    """((model state, torch's optimizer state, id(parameter) -> name, each group's names), keep):
    the names None where the state may not be reused."""
    msd, osd = get_state_dict(model, optimizer)  # also creates missing optimizer state
    if not _reusable(msd, model, optimizer):
        return (msd, osd, None, None), False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    names = [n for g in osd["param_groups"] for n in g["params"]]
    return (dict(msd), osd, {id(p): n for p, n in zip(params, names)},
            [list(g["params"]) for g in osd["param_groups"]]), True


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


def _identity(model, optimizer) -> tuple:
    """What the reused model state and names stand for: the parameter and buffer tensors and their
    storage, and the groups' parameters (the optimizer's state dicts are read anew at each reuse)."""
    tensors = chain(model.parameters(), model.buffers())
    return (tuple((id(t), _local(t).data_ptr()) for t in tensors),
            tuple(tuple(map(id, g["params"])) for g in optimizer.param_groups))


def _reusable(msd: dict, model, optimizer) -> bool:
    live = {_local(t).data_ptr() for t in chain(model.parameters(), model.buffers())}
    return (all(isinstance(v, torch.Tensor) and _local(v).data_ptr() in live for v in msd.values())
            and type(optimizer).state_dict is torch.optim.Optimizer.state_dict
            and not getattr(optimizer, "_optimizer_state_dict_pre_hooks", None)
            and not getattr(optimizer, "_optimizer_state_dict_post_hooks", None))
