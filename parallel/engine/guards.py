"""Failures that say what happened instead of hanging: every rank agrees on each step's batch before
any collective of the step, on a non-finite loss before the optimizer step, and a timed-out
collective is reported with the progress every rank last recorded (docs/reliability.md).

Each check costs one small all-gather on the CPU process group per step (gloo; CPU tensors also on
NCCL jobs, whose default group is "cpu:gloo,cuda:nccl"), and on XLA a read of the loss to the host.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class BatchError(ValueError):
    """A rank's batch cannot be trained on; raised on every rank, naming the ranks and why."""


class NonFiniteLossError(FloatingPointError):
    """A non-finite loss with `on_nonfinite: raise`; names the step and the ranks that saw it."""


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the spec's timeout_s; names the lagging ranks."""


def batch_problem(batch, signature: dict | None, rows_expected: int) -> tuple[str | None, dict]:
    """Why this rank's batch is unusable (None when fine), and its signature (keys, dtypes, ranks
    of the tensors) that later batches are held to."""
    if isinstance(batch, dict):
        items = list(batch.items())
    elif isinstance(batch, (list, tuple)):
        items = list(enumerate(batch))
    else:
        return f"a batch must be a dict or tuple of tensors, not {type(batch).__name__}", {}
    bad = [str(k) for k, v in items if not isinstance(v, torch.Tensor)]
    if bad or not items:
        return f"entries {bad or 'none'} are not tensors", {}
    mine = {str(k): (str(v.dtype), v.dim()) for k, v in items}
    if signature is not None and mine != signature:
        missing = sorted(set(signature) - set(mine))
        changed = sorted(k for k in set(signature) & set(mine) if signature[k] != mine[k])
        return (f"keys/dtypes differ from the first batch: missing {missing}, extra "
                f"{sorted(set(mine) - set(signature))}, changed {[(k, signature[k], mine[k]) for k in changed]}"
                ), mine
    sizes = {str(k): (v.shape[0] if v.dim() else 0) for k, v in items}
    if any(s == 0 for s in sizes.values()):
        return f"empty batch (rows per entry: {sizes})", mine
    if len(set(sizes.values())) > 1:
        return f"entries disagree on the batch dimension: {sizes}", mine
    if next(iter(sizes.values())) != rows_expected:
        return (f"{next(iter(sizes.values()))} samples, the spec's step takes {rows_expected} per "
                "rank (micro_batch_size x grad_accum_steps x devices per process)"), mine
    return None, mine


def agree(ok: bool, message: str | None, world: int) -> dict[int, str]:
    """Every rank learns which ranks are not ok, and why (a second gather only when one is not)."""
    if world == 1 or not dist.is_initialized():
        return {} if ok else {0: message or "failed"}
    flags = torch.zeros(world, dtype=torch.int32)
    dist.all_gather_into_tensor(flags, torch.tensor([0 if ok else 1], dtype=torch.int32))
    if not flags.any():
        return {}
    messages = [None] * world
    dist.all_gather_object(messages, message)
    return {r: messages[r] or "failed" for r in range(world) if flags[r]}


def record_progress(rank: int, text: str) -> None:
    """What this rank is doing, in the job's c10d store (readable by any rank after a timeout)."""
    store = _store()
    if store is not None:
        store.set(f"polyshard/progress/{rank}", text)


def progress(world: int) -> dict[int, str]:
    store = _store()
    if store is None:
        return {}
    old = store.timeout
    store.set_timeout(timedelta(seconds=2))
    out = {}
    try:
        for r in range(world):
            try:
                out[r] = store.get(f"polyshard/progress/{r}").decode()
            except Exception:  # noqa: BLE001 - a rank that never reported
                out[r] = "nothing reported"
    finally:
        store.set_timeout(old)
    return out


def is_timeout(err: BaseException) -> bool:
    """A collective that gave up waiting, or whose peer went away (gloo: "Timed out", "Connection
    closed by peer"; NCCL: "Watchdog caught collective operation timeout")."""
    text = str(err).lower()
    return any(w in text for w in ("timed out", "timeout", "deadline", "connection closed",
                                   "connection reset", "peer"))


def timeout_error(rank: int, world: int, what: str, timeout_s: float) -> CollectiveTimeout:
    seen = progress(world)
    mine = seen.get(rank)
    laggards = {r: p for r, p in seen.items() if p != mine}
    who = (", ".join(f"rank {r} last reported '{p}'" for r, p in laggards.items())
           or "every rank reported the same step: a peer died or a collective was skipped")
    return CollectiveTimeout(f"rank {rank}: {what}: a collective did not complete (timeout_s "
                             f"{timeout_s:g} s, or a peer went away) while this rank was at "
                             f"'{mine}'; {who}")


def _store():
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
