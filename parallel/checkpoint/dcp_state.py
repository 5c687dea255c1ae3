"""Portable state (parallel/checkpoint/portable.py) for modules torch's `get_state_dict` understands: plain modules,
FSDP1 and FSDP2. It strips wrapper prefixes (`_fsdp_wrapped_module`, `_checkpoint_wrapped_module`) and
keys optimizer state by parameter name, which is exactly the portable layout."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from parallel.checkpoint.optim_state import groups_template, merge_groups
from parallel.checkpoint.portable import load_state, open_state, save_state
from parallel.checkpoint.sink import Sink


def write_model_optim(sink: Sink, model, optimizer, sharded: bool, rank: int,
                      on_cpu: bool = False) -> None:
    if sharded:  # every rank writes its own shards (DTensor / ShardedTensor chunks)
        msd, osd = get_state_dict(model, optimizer)
        save_state({"model": msd, "optim": osd}, sink)
        return
    # Full: the state is gathered and rank 0 writes whole tensors. On accelerators it is gathered
    # onto rank 0's CPU only (cpu_offload). On a CPU device torch 2.9's FSDP1 segfaults in that path
    # (measured, docs/fsdp.md) and the tensors are in CPU memory anyway, so every rank gathers.
    options = StateDictOptions(full_state_dict=True, cpu_offload=not on_cpu)
    msd, osd = get_state_dict(model, optimizer, options=options)
    if rank == 0:
        save_state({"model": msd, "optim": osd}, sink, collective=False)


def read_model_optim(path: Path, model, optimizer) -> None:
    # The templates come from this run's own sharding: DCP reshards into them, whatever world size
    # or backend wrote the files. get_state_dict also creates optimizer state that does not exist yet.
    msd, osd = get_state_dict(model, optimizer)
    reader = open_state(path)
    template = {"model": msd, "optim": {"state": osd["state"],
                                        "param_groups": groups_template(path, reader)}}
    load_state(template, path, reader=reader)
    groups = merge_groups(osd["param_groups"], template["optim"]["param_groups"],
                          [g["params"] for g in osd["param_groups"]])
    set_state_dict(model, optimizer, model_state_dict=template["model"],
                   optim_state_dict={"state": template["optim"]["state"], "param_groups": groups})
