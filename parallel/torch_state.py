"""Model + optimizer state through torch.distributed.checkpoint: one code path for plain modules, FSDP1
and FSDP2. `get_state_dict` strips wrapper prefixes (`_fsdp_wrapped_module`, `_checkpoint_wrapped_module`),
so the keys are the original model's parameter names and any world size can read them back."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

SHARDED_DIR, FULL_FILE = "model_optim", "model_optim.pt"
# DCP's own writer calls the deprecated tensor.storage(); the warning is torch's, not the user's.
warnings.filterwarnings("ignore", message="TypedStorage is deprecated")


def write_model_optim(tmp: Path, model, optimizer, sharded: bool, rank: int,
                      on_cpu: bool = False) -> None:
    if sharded:
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp / SHARDED_DIR)
        return
    # On accelerators the full state is gathered onto rank 0's CPU only (cpu_offload). On a CPU
    # device torch 2.9's FSDP1 segfaults in that path (measured, docs/fsdp.md), and the tensors are
    # in CPU memory anyway, so every rank gathers and only rank 0 writes.
    options = StateDictOptions(full_state_dict=True, cpu_offload=not on_cpu)
    msd, osd = get_state_dict(model, optimizer, options=options)
    if rank == 0:
        torch.save({"model": msd, "optim": osd}, tmp / FULL_FILE)


def read_model_optim(path: Path, model, optimizer) -> None:
    if (path / SHARDED_DIR).is_dir():
        # The templates come from this run's own sharding: DCP reshards into them, whatever world
        # size wrote the files. get_state_dict also creates optimizer state that does not exist yet.
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path / SHARDED_DIR)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        return
    full = torch.load(path / FULL_FILE, map_location="cpu", mmap=True, weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optim"],
                   options=StateDictOptions(full_state_dict=True))
