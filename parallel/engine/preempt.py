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
from pathlib import Path

import torch

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
        self.pinned = device.type == "cuda"
        self.ring: deque = deque()
        self.free: list[torch.Tensor] = []  # host buffers read and returned: lag + 1 in all

    def _buffer(self) -> torch.Tensor:
        return self.free.pop() if self.free else torch.zeros(1, pin_memory=self.pinned)

    def record(self, step: int, reduced: torch.Tensor) -> None:
        host = self._buffer()
        host.copy_(reduced.reshape(1).float(), non_blocking=True)
        event = None
        if reduced.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.ring.append((step, host, event))

    def agreed(self, step: int) -> float:
        """The fraction of ranks signalled in step `step - lag` (0 when none, or when that step was not recorded)."""
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


class PreemptionMixin:
    """The Engine's side: needs spec, step, world_size, device, save() and `_agreed_flag()`."""

    _signals: SignalFlag | None = None
    _agreed: AgreedFlag | None = None
    _preempted: Preempted | None = None  # saved; raised by the next train_step

    def _install_preemption(self) -> None:
        """After prepare: catch the spec's signals when there is a `checkpoint.dir` to save into
        (without one a preemption could only lose the run: the signals keep their default)."""
        names = self.spec.checkpoint.preemption_signals
        if names and self.spec.checkpoint.dir:
            self._agreed = self._agreed_flag()
            # an agreement that hears the signals itself (torch_xla's sync manager) needs no flag
            self._signals = SignalFlag(names) if self._agreed.rides_loss else None

    _started = False  # this process has passed its first train_step's start-up check

    def _check_start(self) -> None:
        """Once per process, at its first train_step: a signal caught during start-up (building,
        sharding, resuming) means nothing was trained since the last checkpoint, so every rank exits
        to requeue without writing one. One all-reduce of one element, once per process; from then
        on the flag rides each step's loss reduction."""
        if self._started or self._signals is None:
            return
        from parallel.engine import dist as pdist

        self._started = True
        caught = pdist.all_mean(torch.full((), self._signals.caught, device=self.device))
        if float(caught) > 0:
            message = (f"preempted before the first step of this launch: nothing was trained since "
                       f"it started, so no checkpoint was written; exiting with {REQUEUE_EXIT} so "
                       "the job is requeued (it resumes from the previous checkpoint, if any)")
            if self.is_main:
                print(message, file=sys.stderr, flush=True)
            self._preempted = Preempted(message)

    def _agreed_flag(self) -> AgreedFlag:
        return AgreedFlag(self.device)

    def _reduce_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The step's one reduction: the mean loss over ranks and, in the same tensor, the fraction
        of ranks that caught a preemption signal (recorded, read `lag` steps later)."""
        from parallel.engine import dist as pdist

        if self._signals is None:
            return pdist.all_mean(local)
        flag = torch.full((), self._signals.caught, device=local.device)
        packed = pdist.all_mean(torch.stack([local.float(), flag]))
        self._agreed.record(self.step + 1, packed[1])
        return packed[0]

    def _maybe_preempt(self) -> None:
        """At the end of a step, on every rank alike: if the ranks agreed on a signal, save now
        (before the loop draws the next batch, so the data position is this step's) and make the
        next train_step raise Preempted; this step's result is still returned and logged."""
        if self._agreed is None or self._preempted or self._agreed.agreed(self.step + 1) <= 0:
            return
        path = self.save(Path(self.spec.checkpoint.dir) / f"step-{self.step:08d}", async_save=False)
        mine = ("torch_xla's preemption sync point was reached" if self._signals is None
                else f"this rank caught {signal.Signals(self._signals.signum).name}"
                if self._signals.signum else "another rank caught the signal")
        message = (f"preempted after step {self.step} ({mine}): checkpoint {path} is complete and "
                   f"`latest`; exiting with {REQUEUE_EXIT} so the job is requeued and resumes from "
                   "it (checkpoint.resume: auto)")
        if self.is_main:  # a SystemExit prints nothing by itself
            print(message, file=sys.stderr, flush=True)
        self._preempted = Preempted(message, path)
