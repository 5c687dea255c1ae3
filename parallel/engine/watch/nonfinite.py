"""A non-finite loss, found with what the step already does (docs/reliability.md, "What a step
pays"): it travels in the loss reduction the step does anyway, since a sum over ranks is NaN or inf
exactly when a term is. `raise`/`skip` read that sum once before the update (the step's one host
read, kept for `StepResult.loss`); `raise_deferred` never waits for it (NonfiniteWatch). Which ranks
saw it is gathered only on that failure path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.kits import device as devices


class NonFiniteLossError(FloatingPointError):
    """A non-finite loss with `on_nonfinite: raise` or `raise_deferred`; names the step."""



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
    device event; on CPU the copy is immediate), so no step ever waits on the device for it. Backends
    whose device copies differently (XLA: a step closure) override `publish`."""

    def __init__(self, device: torch.device):
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # steps, counted on device
        self.first = torch.zeros(2, dtype=torch.int64, device=device)
        self.host = torch.zeros(2, dtype=torch.int64, pin_memory=devices.on_accelerator(device))
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
        self.event = devices.recorded_event(self.first.device)

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
