"""Facts about the host read from its environment (no torch import: the registry and CLI use these)."""

from __future__ import annotations

import os


def detect_pjrt_device() -> str:
    """PJRT_DEVICE for XLA: an exported value wins; TPU when the host has TPU chips (TPU VMs expose
    /dev/accel* or /dev/vfio/*); else CPU. Set explicitly, so transformers never prints its
    'Defaulting to PJRT_DEVICE=CPU' guess and nothing runs on the wrong device silently."""
    if os.environ.get("PJRT_DEVICE"):
        return os.environ["PJRT_DEVICE"]
    tpu = any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0"))
    return "TPU" if tpu else "CPU"


def detect_launcher(env=None) -> str:
    """What started this process: `torchrun` (it exports TORCHELASTIC_RUN_ID, or RANK and
    LOCAL_RANK), `slurm` (an srun task: SLURM_PROCID, without torchrun), `tpu-vm` (TPU chips
    visible, no launcher), or `local`."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "LOCAL_RANK" in env):
        return "torchrun"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return "slurm"
    if detect_pjrt_device() == "TPU" and not env.get("PJRT_DEVICE"):
        return "tpu-vm"
    return "local"


# The node count a cluster scheduler gave this launch: Slurm's step (srun sets SLURM_STEP_NUM_NODES;
# SLURM_NNODES is the same inside a step), Kubeflow's PyTorchJob (PET_NNODES, "N" or elastic
# "MIN:MAX"), a TPU VM slice (TPU_WORKER_HOSTNAMES, one name per host).
SCHEDULER_NODES = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "PET_NNODES")


def scheduler_nodes(env=None) -> tuple[str, str, int] | None:
    """(variable, its value, nodes) from the first scheduler variable set, else None."""
    env = os.environ if env is None else env
    for name in SCHEDULER_NODES:
        value = env.get(name, "").strip()
        if value:
            try:
                return name, value, int(value.rsplit(":", 1)[-1])
            except ValueError:
                return None
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    return ("TPU_WORKER_HOSTNAMES", env["TPU_WORKER_HOSTNAMES"], len(hosts)) if hosts else None
