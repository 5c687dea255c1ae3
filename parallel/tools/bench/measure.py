"""Measurements for `polyshard bench`: collective bytes counted as they are issued, and the exact bytes
a rank holds in parameters, gradients and optimizer state.

Counting: every torch.distributed collective, whoever calls it (FSDP1, FSDP2, DeepSpeed's comm layer,
which keeps its own references to torch.distributed's functions), reaches the dispatcher as a c10d op,
so a TorchDispatchMode sees them all (counting.OpWatch, which also sees those DTensor issues).
All-gather counts its output (the gathered tensor),
reduce-scatter its input, all-reduce and broadcast their tensor. XLA's collectives are compiled into
the graph and never reach c10d: they are not counted (reported as such, never estimated).
"""

from __future__ import annotations

import resource
from collections import defaultdict
from contextlib import contextmanager

import torch

from parallel.tools.bench.counting import OpWatch, group_size

# c10d op -> (collective type, index of the argument whose bytes count)
COLLECTIVES = {
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "reduce_": ("reduce", 0),  # DeepSpeed reduces gradient buckets to their partition's owner
    "alltoall_base_": ("all_to_all", 1),  # topology.cp's exchanges: the bytes a rank sends
    "send": ("send", 0),  # topology.pp's activations and their gradients, between stages
}


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(t) for t in obj)
    return 0


# functional collectives (DTensor's: tensor parallelism, a DTensor norm), counted by the same rule
# from their input: all-gather's output is the input times the group
FUNCTIONAL = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce",
              "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


def _count(counter: CommCounter, name: str, args) -> None:
    space, _, op = name.partition("::")
    if space == "c10d":
        kind = COLLECTIVES.get(op)
        if kind is not None and len(args) > kind[1] and group_size(args) > 1:
            counter.bytes[kind[0]] += _nbytes(args[kind[1]])
            counter.calls[kind[0]] += 1
    elif space == "_c10d_functional" and op in FUNCTIONAL and args:
        size = group_size(args)
        if size > 1:
            kind = FUNCTIONAL[op]
            counter.bytes[kind] += _nbytes(args[0]) * (size if kind == "all_gather" else 1)
            counter.calls[kind] += 1


class CommCounter:
    """Bytes and calls per collective type while `counting()` is active on this rank."""

    def __init__(self):
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def counting(self):
        with OpWatch(lambda name, args: _count(self, name, args)):
            yield self

    def snapshot(self) -> dict:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls)}


def held_bytes(tensors) -> int:
    """Bytes of distinct storage behind `tensors` (views of one buffer are counted once; DTensors
    count their local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        if t.device.type == "meta" or t.numel() == 0:
            continue
        try:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
        except (RuntimeError, NotImplementedError):  # a device tensor with no host storage to
            total += t.numel() * t.element_size()  # inspect (XLA): the local tensor's own size
            continue
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def live_tensor_bytes() -> int:
    """Bytes of every distinct host storage behind a tensor Python can reach in this process (the
    model, its shards and flat buffers, optimizer state, gradients, batches): what a rank holds
    between steps, whoever allocated it."""
    import gc

    def on_host(t) -> bool:
        try:
            return t.device.type == "cpu" or hasattr(t, "to_local")
        except RuntimeError:  # a tensor subclass with no device of its own (a wrapper): its
            return False  # storage is a tensor found on its own

    # by type, not isinstance: torch 2.15's compile leaves weakref proxies among the objects, and
    # isinstance on a dead one raises ReferenceError (a proxy is no tensor of its own)
    return held_bytes(o for o in gc.get_objects()
                      if issubclass(type(o), torch.Tensor) and on_host(o))


def step_peak_bytes(step) -> dict | None:
    """The most bytes of tensors this rank holds at any moment of `step()`, and between steps, on
    CPU or CUDA: CUDA's allocator counts its own peak; on CPU, the live storages before the step
    plus the highest running sum of torch.profiler's allocation events during it (every tensor the
    CPU allocator hands out and takes back, in time order). None on devices neither sees (XLA's
    tensors live in the PJRT client)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        boundary = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        return {"boundary": boundary, "peak": torch.cuda.max_memory_allocated(), "by": "cuda"}
    from torch.profiler import ProfilerActivity, profile

    boundary = live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    if not events:
        return None  # nothing reached the CPU allocator: the step's tensors live elsewhere (XLA)
    running = highest = 0
    for _, nbytes in events:
        running += nbytes
        highest = max(highest, running)
    return {"boundary": boundary, "peak": boundary + highest, "by": "profiler"}
