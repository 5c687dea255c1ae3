"""One cell of `polyshard bench`, on every rank of a fresh launch: the shared initial weights and global
batches (parallel/parity_run.py), `--warmup` steps, then `--steps` measured steps. Per step: wall time
with the loss read back (so asynchronous devices have finished), loss. Per rank: bytes held in
parameters, gradients (at the step boundary, their peak) and optimizer state, peak RSS, CUDA peak, and
collective bytes by type. Rank 0 writes every rank's numbers to `--out`."""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.launch.torchrun import current_spec
from parallel.tools.parity.cell import global_batches, optimizer_arg
from parallel.tools.measurable import measurable
from parallel.tools.bench.measure import CommCounter, held_bytes, peak_rss_bytes
from parallel.registry import create_engine
from parallel.toy import build_model


def main() -> None:
    p = argparse.ArgumentParser()
    for name, default in (("model", "toy:tiny"), ("optimizer", "adamw")):
        p.add_argument(f"--{name}", default=default)
    for name, default in (("steps", 5), ("warmup", 2), ("seq", 64), ("global-rows", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.warmup < 1:
        raise SystemExit("bench needs --warmup >= 1: collectives are counted on a warm-up step")

    spec = current_spec()
    engine = create_engine(spec)
    torch.manual_seed(spec.seed)
    model = build_model(args.model)
    params_total = sum(p.numel() for p in model.parameters())
    engine.prepare(model, optimizer_arg(args.optimizer, args.lr))
    rows = engine.samples_per_step
    batches = global_batches(args.warmup + args.steps, args.global_rows, args.seq,
                             model.config.vocab_size, spec.seed)
    grads_peak = [0]
    measurable(engine, "polyshard bench")
    engine.on_gradients.append(lambda e: grads_peak.__setitem__(
        0, max(grads_peak[0], held_bytes(e.state_tensors()["grads"]))))
    counter, times, losses = CommCounter(), [], []
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for i, ids in enumerate(batches):
        mine = ids[engine.rank * rows:(engine.rank + 1) * rows]
        # Collectives are counted on the last warm-up step only: the counting dispatch mode sees
        # every op in Python (measured: +25% step time), so timed steps run without it.
        counting = counter.counting() if i == args.warmup - 1 else nullcontext()
        with counting:
            start = time.perf_counter()
            loss = engine.train_step({"input_ids": mine, "labels": mine}).loss  # waits for the step
            elapsed = time.perf_counter() - start
        losses.append(loss)
        if i >= args.warmup:
            times.append(elapsed)
    held = engine.state_tensors()
    mine = {"rank": engine.rank, "params_bytes": held_bytes(held["params"]),
            "optimizer_bytes": held_bytes(held["optimizer"]), "grads_bytes": grads_peak[0],
            "rss_peak_bytes": peak_rss_bytes(), "comm": counter.snapshot(),
            "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else None}
    ranks = [None] * engine.world_size
    dist.all_gather_object(ranks, mine)
    if engine.is_main:
        Path(args.out).write_text(json.dumps({
            "world_size": engine.world_size, "devices": engine.world_size * engine.devices_per_process,
            "step_times": times, "losses": losses, "tokens_per_step": args.global_rows * args.seq,
            "params": params_total, "ranks": ranks,
            "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}))
    engine.close()


if __name__ == "__main__":
    main()
