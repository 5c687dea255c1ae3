"""Experiment tracking, a part the engine owns: every `tracking.every` steps the main rank logs the
run's metrics to each sink of `tracking.to` (trackers.py), and `engine.log` / `engine.evaluate` log
the user's own and evaluation results.

What a step pays: on other steps nothing but a list append on the main rank (the step's result,
device tensors unread); on a logging step the main rank reads the loss, the gradient norm and the
window's target-token counts to the host (one wait for the device, as a hand-written loop's logging
does). Other ranks do nothing. Rates are over the window's wall time, measured after that read, so
an asynchronous device's queued work is included.

MFU: FLOPs per token by PaLM's count over every token fed, against the device's dense peak
(`tracking.peak_tflops`, or flops.py's table for the GPU; never guessed on a CPU).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from parallel.engine.observe.flops import flops_per_token, peak_flops
from parallel.files import plain_folder
from parallel.kits import device as devices

def device_peak(device: torch.device, precision: str, configured: float | None) -> float | None:
    """tracking.peak_tflops, else the table's figure for this GPU (flops.py); None on a CPU."""
    if configured is not None:
        return configured * 1e12
    if device.type != "cuda":
        return None
    tf32 = torch.get_float32_matmul_precision() != "highest"
    return peak_flops(torch.cuda.get_device_name(device), precision, tf32)


def flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


def default_run_name(spec) -> str:
    """<backend>-<shard>-<start time>; a job that resumes (checkpoint.resume: auto) is one run
    across its launches: <backend>-<shard>-<its checkpoint directory's name>, so a relaunch finds
    the run its first launch started (trackers.py keeps each tracker's run id in its folder)."""
    if spec.checkpoint.resume != "never" and spec.checkpoint.dir:
        return f"{spec.backend}-{spec.shard}-{Path(spec.checkpoint.dir).resolve().name}"
    return f"{spec.backend}-{spec.shard}-{time.strftime('%Y%m%d-%H%M%S')}"


class Tracker:
    """Sinks on the main rank, the window of results since the last log, and what they derive."""

    def __init__(self, spec, is_main: bool, device: torch.device):
        self.options = spec.tracking
        self.active = is_main and bool(self.options.to)
        self.device, self.devices = device, 1
        self.run_name = self.options.run_name or default_run_name(spec)
        self.sinks: list = []
        self.last: dict = {}  # the latest training metrics logged (the progress bar shows them)
        self.last_step = 0
        self._window: list = []  # (result, width) since the last log: tensors unread
        self._since = time.perf_counter()
        self._flops = None
        self._peak = None

    def start(self, spec, flops: tuple | None, devices: int, extra: dict) -> None:
        """At the end of prepare: open the sinks, log the resolved spec and `extra` (model facts).
        `flops`: model_flops() of the model as built; `devices`: every device of the job."""
        if not self.active:
            return
        from parallel.engine.observe.trackers import SINKS

        run_dir = Path(self.options.dir) / self.run_name
        plain_folder(run_dir, "a run folder")  # a planted link would take the trackers' writes
        self.sinks = [SINKS[name](run_dir, self.options.project, self.run_name, self.options)
                      for name in self.options.to]
        self._flops, self.devices = flops, devices
        self._peak = device_peak(self.device, spec.precision, self.options.peak_tflops)
        params = {**flat(spec.model_dump(mode="json")), **extra}
        for sink in self.sinks:
            sink.hparams(params)
        self._since = time.perf_counter()

    def logs_at(self, step: int) -> bool:
        """`step` is a logging step: the same answer on every rank (what all of them must add to
        a reduction that the main rank logs)."""
        return bool(self.options.to) and step % self.options.every == 0

    def after_step(self, result, width: int) -> None:
        if not self.active:
            return
        self._window.append((result, width))
        if result.step % self.options.every == 0:
            self.log(self._train_metrics(), result.step)
            self.last_step = result.step

    def _train_metrics(self) -> dict:
        window, self._window = self._window, []
        last = window[-1][0]
        out = {"train/loss": last.loss, "train/lr": last.lr}  # the read: waits for the device
        if last.metrics is not None:  # the step's own (ep's expert loads): one more read
            names, values = last.metrics
            out.update(zip(names, values.tolist()))
        if last.grad_norm_tensor is not None:
            out["train/grad_norm"] = last.grad_norm
        now = time.perf_counter()
        seconds, self._since = now - self._since, now
        tokens = sum(r.tokens for r, _ in window)
        out["train/step_time_s"] = seconds / len(window)
        out["train/tokens_per_s"] = tokens / seconds  # every token fed, padding included
        targets = [r.targets_tensor for r, _ in window if r.targets_tensor is not None]
        if targets:
            out["train/target_tokens_per_s"] = float(sum(t.float() for t in targets)) / seconds
        mfu = self._mfu(window, seconds)
        if mfu is not None:
            out["train/mfu"] = mfu
        out.update(self._memory())
        self.last = out
        return out

    def _mfu(self, window, seconds: float) -> float | None:
        if self._peak is None or self._flops is None:
            return None
        flops = sum(r.tokens * flops_per_token(*self._flops, width) for r, width in window)
        return flops / seconds / (self._peak * self.devices)

    def _memory(self) -> dict:
        import psutil

        out = {"memory/host_rss_gib": psutil.Process(os.getpid()).memory_info().rss / 2 ** 30}
        if devices.on_accelerator(self.device):  # CUDA, TorchTPU: torch.accelerator's counters
            out["memory/device_peak_gib"] = \
                torch.accelerator.max_memory_allocated(self.device) / 2 ** 30
            torch.accelerator.reset_peak_memory_stats(self.device)  # the next window's own peak
        return out

    def log(self, metrics: dict, step: int) -> None:
        """`metrics` as {name: number}; tensors are read here (main rank only)."""
        if not self.active:
            return
        plain = {k: float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float, torch.Tensor)) and not isinstance(v, bool)}
        for sink in self.sinks:
            sink.log(plain, step)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()
