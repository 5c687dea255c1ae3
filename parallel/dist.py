"""The process group a job runs in, outside the engine: set-up (the one place that reads the launcher's
environment: RANK, WORLD_SIZE, ...), the worker's side of the launcher's error report, seeds and RNG
state, and reductions over named groups (the world, or a parallel dimension's group from the mesh)."""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from parallel.envinfo import detect_launcher
from parallel.kits import device as devices


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    # this job made the default process group (init_distributed found none): its engine's close
    # destroys it. A group the user (or accelerate, or another engine) made is theirs: left alive.
    created: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


JOIN_TIMEOUT_S = 300.0


ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
OWN_MODULES = ("parallel.", "backends.")


def install_error_report() -> None:
    """Record an uncaught exception in torchelastic's error file (idempotent; a no-op when the
    launcher gave no error file)."""
    if not os.environ.get(ERROR_FILE) or getattr(sys.excepthook, "_polyshard", False):
        return
    previous = sys.excepthook

    def hook(kind, err, tb):
        rank = os.environ.get("RANK", "?")
        own = kind.__module__.startswith(OWN_MODULES)
        text = "".join(traceback.format_exception(kind, err, tb))
        with open(os.environ[ERROR_FILE], "w") as f:
            json.dump({"message": {"message": f"{kind.__name__}: {err}", "extraInfo": {
                "py_callstack": text, "timestamp": str(int(time.time()))}},
                "polyshard": {"rank": rank, "time": time.time(), "own": own}}, f)
        if own:  # the message says what to fix: no traceback (it is in the error file);
            print(f"{kind.__name__}: {err}", file=sys.stderr)  # torchrun prefixes the rank
        else:
            previous(kind, err, tb)

    hook._polyshard = True
    sys.excepthook = hook


def launched_world(env=None) -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun (or any PyTorch-style launcher) exported them, or
    as Slurm did when srun starts one task per device without torchrun."""
    env = os.environ if env is None else env
    if detect_launcher(env) == "slurm":
        if "MASTER_ADDR" not in env and int(env["SLURM_NTASKS"]) > 1:
            raise RuntimeError("launched by srun with one task per device, but MASTER_ADDR is not "
                               "set; export MASTER_ADDR (the first node) and MASTER_PORT, or use "
                               "the script from `polyshard launch --emit slurm` (torchrun per node)")
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


# What a launcher (or a library joining for itself) says of the world, in the environment
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "GROUP_RANK", "CROSS_RANK", "CROSS_SIZE")


def launch_env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in LAUNCH_ENV}


def restore_launch_env(saved: dict[str, str | None]) -> None:
    """The launcher's variables as they were before a job: DeepSpeed's initialize sets LOCAL_RANK
    in a process started by hand, and a later Hugging Face object (TrainingArguments, accelerate's
    PartialState) then took the process for a launched rank and failed joining env:// (measured)."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def init_distributed(timeout_s: float, device: str = "auto") -> DistContext:
    """Join (or create) the default process group on `device` (topology.device; parallel/kits/
    device.py): the accelerator's own backend (NCCL on CUDA, tpu_dist on TorchTPU) with gloo for
    CPU tensors, else gloo.

    A single process without a launcher still gets a world of size 1, so FSDP and DCP code paths are
    the same whether one rank or many run them.
    """
    install_error_report()  # under a launcher: the first failing rank is reported once
    rank, world, local_rank = launched_world()
    device, backend = devices.bind(devices.resolve(device), local_rank)
    created = not dist.is_initialized()
    if created:
        # Joining waits for every rank to start (imports, a restart's re-launch: tens of seconds);
        # only then do collectives get the spec's timeout_s (measured: timeout_s 5 made restarted
        # workers fail in gloo's connectFullMesh).
        join = timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S))
        if "MASTER_ADDR" not in os.environ and world == 1:
            # one process started by hand: an in-process store, so nothing listens on the network
            # (a TCPStore server listens on every interface, unauthenticated: docs/security.md)
            store = dist.HashStore()
        else:
            store = _attempt_store(rank, world, join)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=join, store=store)
        # torch 2.15 deprecates _set_pg_timeout for set_timeout, which torch 2.9 lacks
        set_timeout = getattr(dist.distributed_c10d, "set_timeout", None) or \
            dist.distributed_c10d._set_pg_timeout
        set_timeout(timedelta(seconds=timeout_s))
    apply_group_timeout(timeout_s)
    return DistContext(rank, world, local_rank, device, created)


def apply_group_timeout(timeout_s: float) -> None:
    """Process groups made after the default one (DeviceMesh dimensions, DeepSpeed's groups, FSDP1's
    hybrid groups) get torch's module default when made without a timeout (30 min on gloo, 10 min
    on NCCL), not the default group's. Measured: FSDP2 on its mesh waited out a 120 s stall under
    timeout_s 5. The default they read is set to timeout_s, so every collective is bounded by it."""
    c10d = dist.distributed_c10d
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)


def _attempt_store(rank: int, world: int, timeout: timedelta):
    """After an elastic restart, a store namespaced by the attempt. torchrun's agent store outlives
    the workers, and gloo publishes each rank's address under the same key every attempt: a
    restarted rank could read the dead previous rank's address and fail to connect (measured:
    "connectFullMesh failed ... Connection refused" on most restarts). Likewise by the process
    group's generation in this worker: a job after another's close() could read the previous
    group's keys and hang (measured: intermittently, e.g. 1 of 3 runs of two jobs); each rank
    counts its own joins in the store, and ranks join in step, so the counts agree. None: the
    default store."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ:
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent, timeout=timeout)
    generation = store.add(f"polyshard/attempt_{attempt}/joins/{rank}", 1)
    return dist.PrefixStore(f"polyshard/attempt_{attempt}/group_{generation}/", store)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict:
    """Every generator's state in types torch's weights_only unpickler reads (numpy's key array as
    a tensor), so a checkpoint's RNG files load as data (parallel/checkpoint/format/safe.py)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
             "torch": torch.get_rng_state()}
    # a process that never initialised CUDA has no CUDA generator state in use; is_available()
    # would probe the driver on every save (3-4 ms of an async save's 15 ms on a CPU host)
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    elif (kind := devices.accelerator()) and getattr(torch, kind).is_initialized():
        state[kind] = getattr(torch, kind).get_rng_state()  # TorchTPU: this rank's one device
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys  # format <= 2: an ndarray
    np.random.set_state((kind, keys.astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind = devices.accelerator()
    if kind and kind != "cuda" and kind in state:
        getattr(torch, kind).set_rng_state(state[kind])


WORLD = None  # torch's default process group: every rank of the job


@dataclass(frozen=True)
class Groups:
    """The process groups a reduction names (each reduction below takes one; none defaults to the
    world). `dp`: this rank's data-parallel peers, the ranks that hold other rows of the batch and
    the same part of the model (the world where every rank is one: no model-parallel dimension).
    A dimension's peers join here when a reduction over them appears (tp, cp)."""

    dp: object = WORLD
    world: object = WORLD


class PendingSum:
    """A sum over `group` in flight: started when made, waited for when first called (on NCCL the
    wait makes the compute stream wait; the host does not)."""

    def __init__(self, value: torch.Tensor, group):
        self.value, self.work = value, None
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            self.value = value.clone()
            self.work = dist.all_reduce(self.value, op=dist.ReduceOp.SUM, group=group,
                                        async_op=True)

    def __call__(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.value


def data_parallel_group(mesh):
    """The process group of this rank's peers holding other tokens of the step (its TP rank in
    every replica, shard group and cp slice): the mesh's (dp_replicate, dp_shard, cp) flattened, as
    torchtitan flattens its "dp_cp" dims (DeviceMesh._flatten: made once, on every rank, in mesh
    order). Where that is the shard dimension alone, its own group: no flattening, whose cache
    (keyed by the mesh's layout) outlives a destroyed process group and handed a second job in the
    same process the first one's group (measured; forget_meshes now empties it at close)."""
    names = [n for n in ("dp_replicate", "dp_shard", "cp")
             if n in mesh.mesh_dim_names and (n == "dp_shard" or mesh[n].size() > 1)]
    if names == ["dp_shard"]:
        return mesh["dp_shard"].get_group()
    return mesh[tuple(names)]._flatten("_".join(names)).get_group()


def forget_meshes() -> None:
    """Once the default process group is destroyed, every DeviceMesh of the job is dead: torch's
    mesh caches (submeshes' roots, flattened dims) are keyed by a mesh's layout, not its groups, and
    would hand the next job of the same layout in this process the destroyed ones (measured: HSDP x
    TP run twice, "Could not resolve the process group registered under the name 9"). They are
    emptied here (torch's private _mesh_resources: pinned with torch)."""
    from torch.distributed.device_mesh import _mesh_resources

    _mesh_resources.__init__()


def all_mean(value: torch.Tensor, group) -> torch.Tensor:
    """Mean over `group`. gloo has no ReduceOp.AVG, so sum then divide."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
        value /= dist.get_world_size(group)
    return value


def all_max(value: torch.Tensor, group) -> torch.Tensor:
    """Elementwise maximum over `group`."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value


def union_names(names: list[list[str]], group) -> list[list[str]]:
    """Each list of `names` (an optimizer group's parameters) unioned over the ranks of `group`,
    sorted: the whole model's groups where each rank holds a part of it (pipeline stages, ep's
    experts), so that a checkpoint's groups read the same under any layout."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, names, group=group)
    return [sorted({n for each in gathered for n in each[i]}) for i in range(len(names))]
