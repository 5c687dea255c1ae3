"""Preemption: a signal on any subset of ranks becomes one complete checkpoint on every rank and a
requeue exit code (docs/reliability.md, "Preemption").

The signal handler only sets a flag: nothing is saved from inside it (a save there can deadlock on
locks the interrupted code holds, which is how Lightning's handler hangs). The flag travels in the loss
all-reduce every step already does (a second element of the same tensor: no new collective), so the
sum says how many ranks were signalled in that step. Every rank reads that sum LAG steps later, when
the step has long finished (no wait on the step in flight, no host read of the current step), so all
ranks decide at the same step boundary, save synchronously into `checkpoint.dir`, publish `latest`
and raise `Preempted` (a SystemExit with REQUEUE_EXIT). A second signal only sets the flag again; a
kill during the save leaves `latest` on the previous complete checkpoint (atomic publish).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from parallel.kits import device as devices

REQUEUE_EXIT = 85  # the launchers' scripts requeue the job on this code (parallel/launch/emit.py)
LAG = 2  # steps between the step whose reduction carried the flag and the boundary that acts on it


class Preempted(SystemExit):
    """Raised by `train_step` on every rank once the ranks agreed on a preemption signal, after the
    checkpoint is published. Its exit code asks the scheduler to requeue the job."""

    def __init__(self, message: str, path=None):
        super().__init__(REQUEUE_EXIT)
        self.message, self.path = message, path

    def __str__(self) -> str:
        return self.message


class SignalFlag:
    """Catches the configured signals in this process (main thread only, as Python requires)."""

    def __init__(self, names: list[str]):
        self.signum: int | None = None
        self.count = 0
        if threading.current_thread() is not threading.main_thread():
            return
        for name in names:
            signal.signal(getattr(signal, name), self._handler)

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - the signal module's signature
        self.count += 1
        if self.signum is None:
            self.signum = signum

    @property
    def caught(self) -> float:
        return 0.0 if self.signum is None else 1.0


class AgreedFlag:
    """Each step's reduced flag, copied to host memory without waiting, read `lag` steps later.
    Backends whose device reports differently (XLA: a step closure) override `record`."""

    lag = LAG
    rides_loss = True  # the flag travels in the step's loss reduction

    def __init__(self, device: torch.device):
        self.pinned = devices.on_accelerator(device)
        self.ring: deque = deque()
        self.free: list[torch.Tensor] = []  # host buffers read and returned: lag + 1 in all

    def _buffer(self) -> torch.Tensor:
        return self.free.pop() if self.free else torch.zeros(1, pin_memory=self.pinned)

    def record(self, step: int, reduced: torch.Tensor) -> None:
        host = self._buffer()
        host.copy_(reduced.reshape(1).float(), non_blocking=True)
        event = devices.recorded_event(reduced.device)
        self.ring.append((step, host, event))

    def agreed(self, step: int) -> float:
        """The fraction of ranks signalled in step `step - lag` (0 when none, or when that step was
        not recorded)."""
        while self.ring and self.ring[0][0] < step - self.lag:
            self.free.append(self.ring.popleft()[1])
        if not self.ring or self.ring[0][0] != step - self.lag:
            return 0
        _, host, landed = self.ring.popleft()
        if isinstance(landed, threading.Event):
            landed.wait()
        elif landed is not None:
            landed.synchronize()  # `lag` steps old: finished long ago, the queue does not stall
        value = float(host.numpy()[0])
        self.free.append(host)
        return value

    def at(self, step: int) -> None:
        """After a load: records of steps before `step` no longer apply."""
        self.ring.clear()


class Preemption:
    """The engine's preemption part: catches the spec's signals, reads the agreed flag the step's loss
    reduction carried, saves at the step boundary and holds the `Preempted` the next train_step
    raises. Called by the engine at named points: `install` (end of prepare), `check_start` (first
    train_step), `flag`/`record` (inside the step's loss reduction), `after_step`, `at` (after a load)."""

    def __init__(self, spec, is_main: bool):
        self.spec, self.is_main = spec, is_main
        self.signals: SignalFlag | None = None
        self.agreed: AgreedFlag | None = None
        self.pending: Preempted | None = None  # saved; raised by the next train_step
        self.started = False  # this process has passed its first train_step's start-up check

    def install(self, agreed: AgreedFlag) -> None:
        """After prepare: catch the spec's signals when there is a `checkpoint.dir` to save into
        (without one a preemption could only lose the run: the signals keep their default).
        `agreed`: the backend's way of reading the flag back (AgreedFlag by default)."""
        names = self.spec.checkpoint.preemption_signals
        if names and self.spec.checkpoint.dir:
            self.agreed = agreed
            # an agreement that hears the signals itself (torch_xla's sync manager) needs no flag
            self.signals = SignalFlag(names) if agreed.rides_loss else None

    def check_start(self, device: torch.device) -> None:
        """Once per process, at its first train_step: a signal caught during start-up (building,
        sharding, resuming) means nothing was trained since the last checkpoint, so every rank exits
        to requeue without writing one. One all-reduce of one element, once per process; from then
        on the flag rides each step's loss reduction."""
        if self.started or self.signals is None:
            return
        from parallel import dist as pdist

        self.started = True
        # every rank: a signal on any of them stops the job
        caught = pdist.all_mean(torch.full((), self.signals.caught, device=device), pdist.WORLD)
        if float(caught) > 0:
            message = (f"preempted before the first step of this launch: nothing was trained since "
                       f"it started, so no checkpoint was written; exiting with {REQUEUE_EXIT} so "
                       "the job is requeued (it resumes from the previous checkpoint, if any)")
            if self.is_main:
                print(message, file=sys.stderr, flush=True)
            self.pending = Preempted(message)

    def flag(self, device: torch.device) -> torch.Tensor | None:
        """This rank's flag, to travel in the step's loss reduction; None when nothing listens."""
        return None if self.signals is None else torch.full((), self.signals.caught, device=device)

    def record(self, step: int, reduced: torch.Tensor) -> None:
        """The reduced flag of `step` (the fraction of ranks signalled), read `lag` steps later."""
        self.agreed.record(step, reduced)

    def at(self, step: int) -> None:
        """After a load: records of steps before `step` no longer apply."""
        if self.agreed is not None:
            self.agreed.at(step)

    def after_step(self, step: int, save: Callable[[Path], Path]) -> None:
        """At the end of a step, on every rank alike: if the ranks agreed on a signal, `save` now
        (before the loop draws the next batch, so the data position is this step's) and make the
        next train_step raise Preempted; this step's result is still returned and logged."""
        if self.agreed is None or self.pending or self.agreed.agreed(step + 1) <= 0:
            return
        path = save(Path(self.spec.checkpoint.dir) / f"step-{step:08d}")
        mine = ("torch_xla's preemption sync point was reached" if self.signals is None
                else f"this rank caught {signal.Signals(self.signals.signum).name}"
                if self.signals.signum else "another rank caught the signal")
        message = (f"preempted after step {step} ({mine}): checkpoint {path} is complete and "
                   f"`latest`; exiting with {REQUEUE_EXIT} so the job is requeued and resumes from "
                   "it (checkpoint.resume: auto)")
        if self.is_main:  # a SystemExit prints nothing by itself
            print(message, file=sys.stderr, flush=True)
        self.pending = Preempted(message, path)
