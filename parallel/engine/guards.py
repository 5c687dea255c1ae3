"""Checks that fail a step with a clear error, paid for with what the step already does
(docs/reliability.md, "What a step pays").

- A malformed batch is checked on its own rank, before any collective of the step: that rank raises
  BatchError and exits, and the launcher ends the job (torchrun's agent; `srun --kill-on-bad-exit`
  in the emitted Slurm script). Its peers need no collective to learn of it.
- A non-finite loss travels in the loss reduction the step already does: a sum over ranks is NaN or
  inf exactly when a term is. `raise`/`skip` read that sum once before the update (the step's one
  host read, kept for `StepResult.loss`); `raise_deferred` never waits for it (NonfiniteWatch). Which
  ranks saw it is gathered only on that failure path.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist


class BatchError(ValueError):
    """This rank's batch cannot be trained on; raised on that rank before any collective."""


class NonFiniteLossError(FloatingPointError):
    """A non-finite loss with `on_nonfinite: raise` or `raise_deferred`; names the step."""


def batch_problem(batch, signature: dict | None, rows_expected: int) -> tuple[str | None, dict]:
    """Why this rank's batch is unusable (None when fine), and its signature (keys, dtypes, ranks
    of the tensors) that later batches are held to."""
    if isinstance(batch, Mapping):
        items = list(batch.items())
    elif isinstance(batch, (list, tuple)):
        items = list(enumerate(batch))
    else:
        return (f"a batch must be a mapping (dict, BatchEncoding) or tuple of tensors, not "
                f"{type(batch).__name__}"), {}
    if not items:
        return "the batch has no entries", {}
    bad = [str(k) for k, v in items if not isinstance(v, torch.Tensor)]
    if bad:
        return non_tensor_fix(bad), {}
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


def nonfinite_ranks(local: torch.Tensor, world: int) -> dict[int, float]:
    """Failure path only (every rank is on it: they all read the same non-finite sum): each rank's
    own loss, to name the ones that were not finite."""
    value = float(local)
    values = [value]
    if world > 1 and dist.is_initialized():
        values = [None] * world
        dist.all_gather_object(values, value)
    return {r: v for r, v in enumerate(values) if not torch.isfinite(torch.tensor(v))}


class NonfiniteWatch:
    """`on_nonfinite: raise_deferred`: the first step whose loss was not finite, kept on the device
    (sticky: [global, this rank's own], 0 while none) and copied to the host without waiting for it.
    `check()` runs at the next step, save and close: it reads the host copy once it has landed (a
    CUDA event; on CPU the copy is immediate), so no step ever waits on the device for it. Backends
    whose device copies differently (XLA: a step closure) override `publish`."""

    def __init__(self, device: torch.device):
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # steps, counted on device
        self.first = torch.zeros(2, dtype=torch.int64, device=device)
        self.host = torch.zeros(2, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.event = None

    def at(self, step: int) -> None:
        """The engine's step after a load: the next recorded step is step + 1."""
        self.count.fill_(step)

    def record(self, loss: torch.Tensor, local: torch.Tensor) -> None:
        """After the update: `loss` is the step's sum/mean over ranks, `local` this rank's own."""
        # The step number lives on the device too: a Python int here would be a new constant in
        # every step's graph on XLA (a recompilation per step).
        self.count = self.count + 1
        bad = torch.stack([~torch.isfinite(loss), ~torch.isfinite(local)])
        self.first = torch.where(bad & (self.first == 0), self.count, self.first)
        self.publish()

    def publish(self) -> None:
        self.host.copy_(self.first, non_blocking=True)
        if self.first.device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def check(self, now: int, wait: bool = False) -> None:
        """Raise NonFiniteLossError if a recorded step was not finite. `wait`: read the device now
        (save and close, which wait for the device anyway)."""
        if wait:
            first, mine = self.first.tolist()
        elif self.event is not None and not self.event.query():
            return  # not landed yet: the next check sees it (the record is sticky)
        else:
            first, mine = self.host.numpy().tolist()  # host memory: no device read
        if first:
            own = f"this rank's own loss was non-finite from step {mine}" if mine else \
                "this rank's own loss was finite"
            raise NonFiniteLossError(
                f"step {first}: non-finite loss (the mean over ranks; {own}), found at step {now} "
                "with on_nonfinite: raise_deferred, after that step's update: the parameters are not "
                "finite since then and no checkpoint is written. Resume from the last checkpoint; "
                "on_nonfinite: raise stops before the update and names the ranks (one host read "
                "per step)")


def non_tensor_fix(bad: list[str]) -> str:
    return (f"entries {bad} are not tensors (text columns reach the batch when a dataset keeps "
            "them): drop them (dataset.remove_columns(" + repr(bad) + ") or a collate_fn that "
            "returns tensors only), or give the dataset the torch format "
            "(dataset.with_format('torch', columns=[...]))")
