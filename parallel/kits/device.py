"""The device a rank trains on, through torch's device-generic APIs (torch.accelerator, torch.Event,
the device module `torch.<type>`, the process-group backend torch maps the device to): CUDA and
TorchTPU's `tpu` device (a PrivateUse1 backend that `torch-tpu` registers when torch starts) run the
same code; the CPU runs gloo. `topology.device` names the device; `auto` is torch.accelerator's
when one is present, else the CPU (docs/tpu.md)."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from parallel.kits.problems import SpecError

# topology.device -> (the module that provides it, how to install it); the CPU needs nothing
PROVIDERS = {"cuda": ("torch", "a CUDA build of torch and an NVIDIA GPU"),
             "tpu": ("torch_tpu", "pip install 'polyshard[torchtpu]' (torch-tpu 0.2 with libtpu, "
                                  "on a TPU VM; torch 2.11-2.15)")}


@functools.cache  # a process's accelerator is fixed once torch has started (the watches ask per step)
def accelerator() -> str | None:
    """torch.accelerator's device type on this host (cuda, tpu, ...), or None (a CPU host)."""
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator().type


def resolve(kind: str) -> str:
    """`topology.device` on this host: auto becomes the accelerator's type (cpu without one); a
    named accelerator this host lacks is refused, naming the field and what installs it."""
    here = accelerator()
    if kind == "auto":
        return here if here in PROVIDERS else "cpu"
    if kind == "cpu" or kind == here:
        return kind
    module, install = PROVIDERS[kind]
    missing = module != "torch" and importlib.util.find_spec(module) is None
    why = f"{module} is not installed" if missing else \
        f"torch.accelerator finds {here or 'no accelerator'} on this host" + (
            " (TorchTPU registers its device only where its PCI scan finds TPU chips)"
            if kind == "tpu" else "")
    raise SpecError([("topology.device", f"{kind!r}: {why}. Install and run where it is: "
                      f"{install}; or topology.device: auto (here: {here or 'cpu'})")])


def bind(kind: str, local_rank: int) -> tuple[torch.device, str]:
    """This rank's device (the accelerator's index local_rank, made current) and the process-group
    backend string: gloo for CPU tensors beside the device's own (NCCL on CUDA, TorchTPU's
    tpu_dist), as torch's default_device_backend_map names it."""
    if kind == "cpu":
        return torch.device("cpu"), "gloo"
    torch.accelerator.set_device_index(local_rank)
    backend = torch.distributed.Backend.default_device_backend_map[kind]
    return torch.device(kind, local_rank), f"cpu:gloo,{kind}:{backend}"


def launch_env(kind: str, nnodes: int, procs: int) -> dict[str, str]:
    """What a device's runtime must have decided in the launching process, before any rank starts:
    for TorchTPU, its own torch.tpu.distributed.set_tpu_launch_env (the slice's per-rank addresses,
    its topology, a profiling session; with several hosts NODE_RANK, MASTER_ADDR and MASTER_PORT,
    read off the TPU VM's TPU_WORKER_HOSTNAMES). It never overwrites a variable already set. This
    process's environment is left as it was; the variables are returned. Nothing for CUDA or CPU."""
    if kind != "tpu":
        return {}
    before = dict(os.environ)
    try:
        torch.tpu.distributed.set_tpu_launch_env(nnodes=nnodes, nproc_per_node=procs)
        return {k: v for k, v in os.environ.items() if before.get(k) != v}
    finally:
        os.environ.clear()
        os.environ.update(before)


def on_accelerator(device: torch.device) -> bool:
    """`device` is torch.accelerator's (streams, events and pinned host memory apply); False on
    the CPU and on torch_xla's `xla` devices, which copy through their own step closures."""
    return device.type == accelerator()


def recorded_event(device: torch.device):
    """An event recorded on `device`'s current stream (query() says whether the work queued before
    it has finished), or None where copies to the host are immediate (the CPU)."""
    if not on_accelerator(device):
        return None
    event = torch.Event(device=device)
    event.record()
    return event
