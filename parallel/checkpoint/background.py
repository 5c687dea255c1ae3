"""`checkpoint.async_save`: `save` returns once this rank's state is copied into host memory; a
background thread writes, hashes and publishes it (docs/checkpoint-format.md, "Async save").

Every write path goes through `portable.save_state` with the save's `Sink` (sink.py); a staged sink
copies the state it is given (DTensor shards, ZeRO ranges, whole tensors: only what this rank holds,
O(model / N)) and queues the write instead of doing it. The background thread runs the queued DCP writes and the
checkpoint's collective steps (hash, barrier, manifest, rename, `latest`) over a process group of its
own (gloo), so they never interleave with the training loop's collectives. `latest` moves only after
every rank's files are durable: a crash while writing leaves it on the previous complete checkpoint.
The next `save`, `load` and `close` wait for the write in flight and raise its error, if any.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from parallel.checkpoint.chunks import FlatRange

class PinnedPool:
    """Page-locked host buffers for staging CUDA tensors, reused from one async save to the next.
    Measured on an H100 (125M-parameter Llama, AdamW, one rank): copies into pageable memory made
    `save` block 0.78 s (FSDP2) and 0.56 s (ZeRO-3) against 3.8 s and 3.3 s synchronous; a copy into
    pinned memory runs at the link's speed and without blocking the host, while pinning afresh each
    save costs about what it saves. The buffers stay between saves (as large as this rank's state,
    O(model / N)) until `release`; a save reuses them only after the previous write has finished
    (BackgroundSaver keeps one write in flight)."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []
        self.used = 0
        self.copied = False

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        i, self.used = self.used, self.used + 1
        if i == len(self.buffers):
            self.buffers.append(None)
        buf = self.buffers[i]
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[i] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t.detach(), non_blocking=True)
        self.copied = True
        return buf

    def finish(self) -> None:
        """Every copy issued has landed (the background writer reads the buffers); buffers this
        save did not use (the state changed shape) are dropped."""
        if self.copied:
            torch.cuda.current_stream().synchronize()
        del self.buffers[self.used:]
        self.used, self.copied = 0, False

    def release(self) -> None:
        self.buffers.clear()


def stage(obj, pool: PinnedPool | None = None):
    """A copy of a state in host memory that no later training step can change: each rank's own
    shards and ranges only, so the copy is as large as what the rank holds. CUDA tensors go into
    `pool`'s pinned buffers when one is given."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return {k: stage(v, pool) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(stage(v, pool) for v in obj)
    if isinstance(obj, FlatRange):
        return FlatRange(_host_copy(obj.data, pool), obj.start, obj.shape)
    if isinstance(obj, DTensor):
        return DTensor.from_local(_host_copy(obj.to_local(), pool), obj.device_mesh, obj.placements,
                                  run_check=False, shape=obj.shape, stride=obj.stride())
    if isinstance(obj, ShardedTensor):
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        target = _create_cpu_state_dict({"t": obj})
        return _copy_state_dict({"t": obj}, target)["t"]
    if isinstance(obj, torch.Tensor):
        return _host_copy(obj, pool)
    return copy.deepcopy(obj)


def _host_copy(t: torch.Tensor, pool: PinnedPool | None) -> torch.Tensor:
    if t.is_cuda and pool is not None:
        return pool.copy(t)
    return t.detach().to("cpu", copy=True)


class BackgroundSaver:
    """One write in flight per engine, on one thread, with its own gloo process group."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self.group = None
        self.pinned = PinnedPool()

    def ensure_group(self):
        """Made on the first async save, by every rank in the same order (a collective)."""
        if self.group is None and dist.is_initialized():
            self.group = dist.new_group(backend="gloo")
        return self.group

    def submit(self, fn) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="polyshard-save")
        self._pending = self._pool.submit(fn)

    def wait(self) -> None:
        """Block until the write in flight is published; raise what it raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
