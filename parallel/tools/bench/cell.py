"""One cell of `polyshard bench`, on every rank of a fresh launch: the shared initial weights and global
batches (parallel/parity_run.py), `--warmup` steps, then `--steps` measured steps. Per step: wall time
with the loss read back (so asynchronous devices have finished), loss. Per rank: bytes held in
parameters, gradients (at the step boundary, their peak) and optimizer state, peak RSS, CUDA peak, and
collective bytes by type. Rank 0 writes every rank's numbers to `--out`."""

from __future__ import annotations

import argparse
import json
import shutil
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


def native_step(script: str, flags: list[str], options, spec, rank: int, world: int):
    """The step of a hand-written loop in benchmarks/ (its `build`), for the same job: it runs in
    this launch, alternating with polyshard's step, so both see the same processes, cores and
    caches (separate launches on a 2-core host differed by 20% run to run)."""
    import importlib.util
    import sys

    from parallel.tools.bench.report import NATIVE_DIR

    sys.path.insert(0, str(NATIVE_DIR))  # the loops import their shared `common`
    module_spec = importlib.util.spec_from_file_location(f"native_{Path(script).stem}",
                                                         NATIVE_DIR / script)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    import common

    a = common.args([f"--model={options.model}", f"--seq={options.seq}", f"--lr={options.lr}",
                     f"--global-rows={options.global_rows}", f"--clip={spec.grad_clip or 0.0}",
                     f"--seed={spec.seed}", "--out=-", *flags])
    step = module.build(a, rank, world)
    return lambda ids: common.timed(step, ids, world)


def parse_args():
    p = argparse.ArgumentParser()
    for name, default in (("model", "toy:tiny"), ("optimizer", "adamw")):
        p.add_argument(f"--{name}", default=default)
    for name, default in (("steps", 5), ("warmup", 2), ("seq", 64), ("global-rows", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--native", help="a loop in benchmarks/ to alternate with, and its flags: "
                   "'native_fsdp2.py --stage=3'")
    p.add_argument("--profile", type=int, default=0, help="steps of each side to profile after "
                   "the timed ones (parallel/tools/bench/profile.py)")
    p.add_argument("--profile-dir")
    p.add_argument("--save-dir", help="time a sync and an async save of the trained state here")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.warmup < 1:
        raise SystemExit("bench needs --warmup >= 1: collectives are counted on a warm-up step")
    return args


def main() -> None:
    args = parse_args()
    spec = current_spec()
    engine = create_engine(spec)
    torch.manual_seed(spec.seed)
    model = build_model(args.model)
    params_total = sum(p.numel() for p in model.parameters())
    engine.prepare(model, optimizer_arg(args.optimizer, args.lr))
    rows = engine.samples_per_step
    batches = global_batches(args.warmup + args.steps, args.global_rows, args.seq,
                             model.config.vocab_size, spec.seed)
    native = None
    if args.native:
        script, *flags = args.native.split()
        native = native_step(script, flags, args, spec, engine.rank, engine.world_size)
    grads_peak = [0]
    measurable(engine, "polyshard bench")

    def measure_grads(e):  # walks every gradient: on the counted warm-up step only, never timed
        grads_peak[0] = max(grads_peak[0], held_bytes(e.state_tensors()["grads"]))

    def ours(ids):
        start = time.perf_counter()
        loss = engine.train_step({"input_ids": ids, "labels": ids}).loss  # waits for the step
        return time.perf_counter() - start, loss

    counter, times, losses, theirs = CommCounter(), [], [], {"step_times": [], "losses": []}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for i, ids in enumerate(batches):
        mine = ids[engine.rank * rows:(engine.rank + 1) * rows]
        # Collectives are counted on the last warm-up step only: the counting dispatch mode sees
        # every op in Python (measured: +25% step time), so timed steps run without it.
        counting = counter.counting() if i == args.warmup - 1 else nullcontext()
        engine.on_gradients[:] = [measure_grads] if i == args.warmup - 1 else []
        if native is not None and i % 2:  # alternate which goes first: neither gains from order
            record(theirs, native(mine), i >= args.warmup)
        with counting:
            elapsed, loss = ours(mine)
        losses.append(loss)
        if i >= args.warmup:
            times.append(elapsed)
        elif i == 0:
            first_step = elapsed  # with compile.enabled: the step that compiles
        if native is not None and not i % 2:
            record(theirs, native(mine), i >= args.warmup)
    if args.profile:  # untimed, after the timed steps: the profiler's own cost stays out of them
        from parallel.tools.bench.profile import profile_pair

        more = global_batches(args.profile + 1, args.global_rows, args.seq,
                              model.config.vocab_size, spec.seed + 1)
        profile_pair(ours, native, [b[engine.rank * rows:(engine.rank + 1) * rows] for b in more],
                     Path(args.profile_dir), engine.rank)
    saves = save_times(engine, Path(args.save_dir)) if args.save_dir else None
    held = engine.state_tensors()
    mine = {"saves": saves, "rank": engine.rank, "params_bytes": held_bytes(held["params"]),
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
            "params": params_total, "ranks": ranks, "native": theirs if native else None,
            "first_step_s": first_step, "compile": compile_row(engine),
            "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}))
    engine.close()


def save_times(engine, root: Path) -> dict:
    """Seconds `save` blocks the training loop: synchronous, and with checkpoint.async_save (then
    also until published). Best of two each, after one untimed save of each kind. Each checkpoint
    is removed once timed: six copies of a large model's state would fill the disk."""
    def timed(i: int, background: bool) -> tuple[float, float]:
        path = root / f"{'async' if background else 'sync'}-{i}"
        dist.barrier()
        start = time.perf_counter()
        engine.save(path, async_save=background)
        blocking = time.perf_counter() - start
        engine.wait_for_save()
        total = time.perf_counter() - start
        dist.barrier()  # every rank's files are written before one rank removes them
        if engine.is_main:
            shutil.rmtree(path, ignore_errors=True)
        return blocking, total

    timed(0, False)  # warm: the first save builds DCP's plans and caches
    out = {"sync_s": min(timed(i, False)[0] for i in (1, 2))}
    if engine.background_save:
        timed(0, True)  # warm: the first async save also creates its process group
        runs = [timed(i, True) for i in (1, 2)]
        out.update(async_blocking_s=min(r[0] for r in runs), async_total_s=min(r[1] for r in runs))
    return out


def compile_row(engine) -> dict | None:
    """What torch.compile did on this rank (compile.enabled), for the table's compile column."""
    stats = engine.compile_stats()
    return None if stats is None else stats.row()


def record(into: dict, timed: tuple[float, float], measured: bool) -> None:
    seconds, loss = timed
    into["losses"].append(loss)
    if measured:
        into["step_times"].append(seconds)


if __name__ == "__main__":
    main()
