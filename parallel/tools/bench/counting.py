"""What a training step pays besides its compute, counted per step (not timed): collectives, device to
host reads and store operations. The same counter counts polyshard's step and the native loops in
benchmarks/ (they import it only when asked to count), so the two are compared by one rule.

- collectives: every c10d op (torch.distributed and functional collectives) over more than one rank,
  by op name, seen by a TorchDispatchMode (FSDP1/2 and DeepSpeed's comm layer all reach it);
- host reads: `aten::_local_scalar_dense`, what `.item()`, `float()`, `bool()` and `if t:` of a
  tensor dispatch to (on a GPU each one waits for the device to drain its queue);
- store operations: calls made from Python on any c10d Store (TCPStore, PrefixStore, ...), split
  into writes (set, add, append, compare_set, multi_set, delete_key, queue_push) and reads.

XLA's collectives are compiled into the graph and never reach c10d; a graph execution is counted
instead (`xla_graphs`, torch_xla's ExecuteComputation counter) where torch_xla is loaded.
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

STORE_WRITES = ("set", "add", "append", "compare_set", "multi_set", "delete_key", "queue_push")
STORE_READS = ("get", "multi_get", "check", "wait", "num_keys", "queue_pop", "queue_len")
# waiting on an issued collective is not another one, nor is wrapping a functional one's output for
# autograd (torch 2.15's all_to_all_single_autograd issues _c10d_functional::_wrap_tensor_autograd)
NOT_COLLECTIVES = {"wait_tensor", "wait", "_wrap_tensor_autograd"}


def group_size(args) -> int:
    """c10d ops carry their process group as a TorchScript object, functional collectives (what
    DTensor issues) its registered name last; a one-rank group moves nothing."""
    if args and isinstance(args[-1], str):
        try:
            return torch._C._distributed_c10d._resolve_process_group(args[-1]).size()
        except (RuntimeError, AttributeError):
            pass
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).size()
            except RuntimeError:  # the ReduceOp argument, not the group
                continue
    return 2


class OpWatch(TorchDispatchMode):
    """Calls `on_op(qualified name, args)` for every op, including the ones a tensor subclass
    issues while handling an op: for DTensor arguments the mode steps aside (NotImplemented) so
    DTensor runs the op with the mode still active, and its collectives (a norm's all-reduce
    inside clip_grad_norm_) are seen too, as torch's CommDebugMode does."""

    def __init__(self, on_op=None, after=None):
        super().__init__()
        self.on_op, self.after = on_op, after  # after(name, args, out): once the op has run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        if any(issubclass(t, FakeTensor) for t in types):
            # DTensor's sharding propagation runs an op on fake tensors the first time it sees the
            # op (measured: bench --warmup 1 failed in clip_grad_norm's _foreach_norm with "all
            # __torch_dispatch__ handlers returned NotImplemented"): no real op, nothing to count
            return func(*args, **(kwargs or {}))
        if any(_subclass_dispatch(t) for t in types):
            return NotImplemented
        name = func._overloadpacket._qualified_op_name
        if self.on_op is not None:
            self.on_op(name, args)
        out = func(*args, **(kwargs or {}))
        if self.after is not None:
            self.after(name, args, out)
        return out


def _subclass_dispatch(t: type) -> bool:
    """A tensor subclass that handles ops itself (DTensor), not one that only tags (Parameter)."""
    handler = getattr(t, "__torch_dispatch__", None)
    return handler is not None and getattr(handler, "__func__", handler) is not \
        torch._C._disabled_torch_dispatch_impl


# collectives a library wraps in an op of its own (the c10d call inside runs below the dispatch
# mode, unseen): counted under the c10d op they run. DeepSpeed's Ulysses all-to-all
# (deepspeed/sequence/layer.py: torch.library op "deepspeed::dim_zero_all_to_all").
WRAPPED = {"deepspeed::dim_zero_all_to_all": "c10d::alltoall_base_"}


def _count_op(counts: Counter, name: str, args) -> None:
    name = WRAPPED.get(name, name)
    space, _, op = name.partition("::")
    if space in ("c10d", "_c10d_functional") and op not in NOT_COLLECTIVES:
        if group_size(args) > 1:
            counts[f"collective:{op}"] += 1
    elif name == "aten::_local_scalar_dense":
        counts["host_reads"] += 1


@contextmanager
def _store_calls(counts: Counter):
    """Count every Python call of a Store method on this thread's stores while active."""
    classes = [c for c in (dist.Store, dist.TCPStore, dist.PrefixStore, dist.FileStore,
                           dist.HashStore) if c is not None]
    saved = []
    for cls in classes:
        for name in (*STORE_WRITES, *STORE_READS):
            original = cls.__dict__.get(name)
            if original is None:
                continue
            kind = "store_writes" if name in STORE_WRITES else "store_reads"

            def counted(self, *a, _original=original, _kind=kind, **k):
                counts[_kind] += 1
                return _original(self, *a, **k)

            setattr(cls, name, counted)
            saved.append((cls, name, original))
    try:
        yield
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)


def _xla_graphs() -> int:
    if "torch_xla" not in sys.modules:
        return 0
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    xm.wait_device_ops()  # graphs run asynchronously: count the ones issued so far, all finished
    return (met.counter_value("ExecuteComputation") or 0) + (
        met.counter_value("ExecuteReplicated") or 0)


class StepCounter:
    """`with counter.step():` around one step; `counter.steps` holds one Counter per step."""

    def __init__(self):
        self.steps: list[Counter] = []

    @contextmanager
    def step(self):
        counts: Counter = Counter()
        graphs = _xla_graphs()
        with _store_calls(counts), OpWatch(lambda name, args: _count_op(counts, name, args)):
            yield counts
        ran = _xla_graphs() - graphs  # 0 without torch_xla, or when no graph ran: not recorded
        if ran:
            counts["xla_graphs"] += ran
        self.steps.append(counts)

    def per_step(self) -> dict[str, int]:
        """The counts of a steady step; ValueError when steps differ (not yet steady)."""
        first = dict(self.steps[0])
        for i, other in enumerate(self.steps[1:], 2):
            if dict(other) != first:
                raise ValueError(f"counted step {i} differs from the first: {dict(other)} vs {first}")
        return dict(sorted(first.items()))
