"""`engine.progress_bar(total)`: the training loop's progress where a person reads it.

A terminal or a notebook gets rich's live bar (rich renders Jupyter output itself); a log file or a
pipe gets one plain line every `tracking.every` steps, so a CI log is not a wall of carriage
returns. Main rank only (other ranks get a bar that does nothing). The loss and rates shown are the
tracker's when it logged this step, else read on the same steps the tracker would read them, so the
bar adds no host read of its own between them.
"""

from __future__ import annotations

import sys
import time


def _describe(metrics: dict) -> str:
    parts = [f"loss {metrics['train/loss']:.4f}"]
    if "train/grad_norm" in metrics:
        parts.append(f"|g| {metrics['train/grad_norm']:.3g}")
    parts.append(f"lr {metrics['train/lr']:.2e}")
    if "train/tokens_per_s" in metrics:
        parts.append(f"{metrics['train/tokens_per_s']:,.0f} tok/s")
    if "train/mfu" in metrics:
        parts.append(f"MFU {100 * metrics['train/mfu']:.1f}%")
    return " ".join(parts)


class ProgressBar:
    def __init__(self, engine, total: int | None, description: str):
        from rich.console import Console

        self.engine, self.total, self.description = engine, total, description
        self.every = engine.spec.tracking.every
        self.console = Console(file=sys.stderr, quiet=not engine.is_main)
        self.live = engine.is_main and (self.console.is_terminal or self.console.is_jupyter)
        self.lines: list[str] = []  # what the plain mode printed (tests read it)
        self._progress = self._task = None
        self._since, self._tokens = time.perf_counter(), 0

    def __enter__(self) -> ProgressBar:
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
                TimeRemainingColumn

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                      MofNCompleteColumn(), TimeRemainingColumn(),
                                      console=self.console)
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total,
                                                 completed=self.engine.step)
        return self

    def update(self, result) -> None:
        """After each train_step, with its StepResult."""
        if not self.engine.is_main:
            return
        self._tokens += result.tokens
        shown = result.step % self.every == 0 or (self.total is not None and
                                                 result.step >= self.total)
        text = self._text(result) if shown else None
        if self._progress is not None:
            self._progress.update(self._task, completed=result.step,
                                  **({"description": text} if text else {}))
        elif text:
            of = f"/{self.total}" if self.total else ""
            line = f"{self.description} step {result.step}{of} {text}"
            self.lines.append(line)
            self.console.print(line, highlight=False, soft_wrap=True)

    def _text(self, result) -> str:
        tracker = self.engine.tracker
        if tracker.active and tracker.last_step == result.step:
            self._since, self._tokens = time.perf_counter(), 0
            return _describe(tracker.last)
        metrics = {"train/loss": result.loss, "train/lr": result.lr}  # the read
        if result.grad_norm_tensor is not None:
            metrics["train/grad_norm"] = result.grad_norm
        now = time.perf_counter()  # after the read: the device's queued work is in the window
        metrics["train/tokens_per_s"] = self._tokens / max(now - self._since, 1e-9)
        self._since, self._tokens = now, 0
        return _describe(metrics)

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
