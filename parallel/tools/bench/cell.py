"""One cell of `polyshard bench`, on every rank of a fresh launch: the shared initial weights and global
batches (parallel/tools/parity/cell.py), `--warmup` steps, then `--steps` measured steps. Per step: wall time
with the loss read back (so asynchronous devices have finished), loss. Per rank: bytes held in
parameters, gradients (at the step boundary, their peak) and optimizer state, the tensors held at
the step's peak (measure.step_peak_bytes: one more step, untimed), peak RSS, CUDA peak, and
collective bytes by type. Rank 0 writes every rank's numbers to `--out`."""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.engine.observe.flops import flops_per_token, model_flops
from parallel.launch.torchrun import current_spec
from parallel.tools.parity.cell import global_batches, optimizer_arg, prepare_kwargs
from parallel.kits.measurable import measurable
from parallel.tools.bench.measure import CommCounter, held_bytes, peak_rss_bytes, step_peak_bytes
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
    return lambda batch: common.timed(step, batch["input_ids"], world)  # the loops train on ids


def parse_args():
    p = argparse.ArgumentParser()
    for name, default in (("model", "toy:tiny"), ("optimizer", "adamw")):
        p.add_argument(f"--{name}", default=default)
    for name, default in (("steps", 5), ("warmup", 2), ("seq", 64), ("global-rows", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", help="module:function giving the global batches (batch_source)")
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
    flops = flops_per_token(*model_flops(model), args.seq)  # counted as the tracker's train/mfu
    engine.prepare(model, optimizer_arg(args.optimizer, args.lr), **prepare_kwargs(args.optimizer))
    batches = batch_source(args, model, spec.seed, spec.compute)
    native = None
    if args.native:
        script, *flags = args.native.split()
        native = native_step(script, flags, args, spec, engine.rank, engine.world_size)
    measurable(engine, "polyshard bench")
    run = run_steps(engine, batches, native, args.warmup)
    memory = None
    if native is None and engine.device.type in ("cpu", "cuda"):  # the native loop's own model
        # would count too; untimed, after the timed steps (the profiler costs time)
        memory = step_peak_bytes(lambda: ours(engine, mine(engine, batches[-1])))
    if args.profile:  # untimed, after the timed steps: the profiler's own cost stays out of them
        from parallel.tools.bench.profile import profile_pair

        more = global_batches(args.profile + 1, args.global_rows, args.seq,
                              model.config.vocab_size, spec.seed + 1)
        profile_pair(lambda b: ours(engine, b), native,
                     [mine(engine, {"input_ids": b, "labels": b}) for b in more],
                     Path(args.profile_dir), engine.rank)
    saves = None
    if args.save_dir:
        from parallel.tools.bench.saves import save_cell

        saves = save_cell(engine, Path(args.save_dir), [mine(engine, b) for b in batches[args.warmup:]])
    ranks = per_rank(engine, saves, run["grads_peak"], run["counter"], memory)
    if engine.is_main:
        Path(args.out).write_text(json.dumps({
            "world_size": engine.world_size, "devices": engine.world_size * engine.devices_per_process,
            "step_times": run["times"], "losses": run["losses"],
            **token_counts(batches[args.warmup:]), "params": params_total, "ranks": ranks,
            "flops_per_token": flops,
            "native": run["theirs"] if native else None, "first_step_s": run["first_step"],
            "compile": compile_row(engine),
            "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}))
    engine.close()


def ours(engine, batch) -> tuple[float, float]:
    """(seconds, loss) of one of polyshard's steps; reading the loss waits for the step."""
    start = time.perf_counter()
    loss = engine.train_step(batch).loss
    return time.perf_counter() - start, loss


def mine(engine, batch) -> dict:
    """This rank's rows of a global batch."""
    rows = engine.samples_per_step
    return {k: v[engine.dp_rank * rows:(engine.dp_rank + 1) * rows] for k, v in batch.items()}


def run_steps(engine, batches: list[dict], native, warmup: int) -> dict:
    """The warm-up and timed steps, alternating with the native loop's (`native`, or None) so that
    neither gains from order; collectives and gradient memory counted on the last warm-up step."""
    grads_peak = [0]

    def measure_grads(e):  # walks every gradient: on the counted warm-up step only, never timed
        grads_peak[0] = max(grads_peak[0], held_bytes(e.state_tensors()["grads"]))

    counter, times, losses, theirs = CommCounter(), [], [], {"step_times": [], "losses": []}
    first_step = None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for i, batch in enumerate(batches):
        local = mine(engine, batch)
        # Collectives are counted on the last warm-up step only: the counting dispatch mode sees
        # every op in Python (measured: +25% step time), so timed steps run without it.
        counting = counter.counting() if i == warmup - 1 else nullcontext()
        engine.on_gradients[:] = [measure_grads] if i == warmup - 1 else []
        if native is not None and i % 2:  # alternate which goes first: neither gains from order
            record(theirs, native(local), i >= warmup)
        with counting:
            elapsed, loss = ours(engine, local)
        losses.append(loss)
        if i >= warmup:
            times.append(elapsed)
        elif i == 0:
            first_step = elapsed  # with compile.enabled: the step that compiles
        if native is not None and not i % 2:
            record(theirs, native(local), i >= warmup)
    return {"times": times, "losses": losses, "theirs": theirs, "first_step": first_step,
            "grads_peak": grads_peak[0], "counter": counter}


def batch_source(args, model, seed: int, precision: str = "fp32") -> list[dict]:
    """warm-up + timed global batches: the shared random ids (parallel/tools/parity/cell.py), or
    the user's `--data module:function`, called with the arguments it names of rows (the global
    batch's), seq, steps, seed and vocab_size, yielding dicts of tensors (input_ids, labels,
    attention_mask, ... as an HF collator gives them) of `rows` rows each, or yielding tokenized
    documents (dicts whose input_ids is one sequence), which are packed into rows of `seq` tokens
    as engine.dataloader(pack_to=seq) packs them."""
    steps = args.warmup + args.steps
    if not args.data:
        return [{"input_ids": ids, "labels": ids} for ids in global_batches(
            steps, args.global_rows, args.seq, model.config.vocab_size, seed)]
    import inspect
    import itertools

    from parallel.toy import load_factory

    factory = load_factory(args.data, "--data", "a function returning the global batches")
    offered = {"rows": args.global_rows, "seq": args.seq, "steps": steps, "seed": seed,
               "vocab_size": getattr(getattr(model, "config", None), "vocab_size", None)}
    named = inspect.signature(factory).parameters
    source = iter(factory(**{k: v for k, v in offered.items() if k in named}))
    first = next(source, None)
    if is_document(first):  # documents, not batches: packed into rows of seq as pack_to packs
        return packed_batches(itertools.chain([first], source), args, model, precision, steps)
    got = [dict(b) for b in itertools.islice(itertools.chain([first] if first else [], source),
                                            steps)]
    wrong = [i for i, b in enumerate(got) if len(b.get("input_ids", ())) != args.global_rows]
    if len(got) < steps or wrong:
        raise SystemExit(f"--data {args.data}: gave {len(got)} batches (needs {steps}) "
                         f"{f'and batch {wrong[0]} has not {args.global_rows} rows ' if wrong else ''}"
                         f"of input_ids: every batch is the global batch, `rows` rows")
    return got


def is_document(item) -> bool:
    """One tokenized document (a dict whose input_ids is a 1-D sequence), not a batch of rows."""
    ids = item.get("input_ids") if isinstance(item, dict) else None
    return ids is not None and (ids.dim() == 1 if torch.is_tensor(ids) else
                                bool(ids) and not isinstance(ids[0], (list, tuple)))


def packed_batches(docs, args, model, precision: str, steps: int) -> list[dict]:
    """`steps` global batches of `rows` packed rows of `seq` tokens from a stream of documents,
    with polyshard's packer and the masks the model's attention takes (parallel/engine/data/
    packing.py): benchmarking one's own packed data needs no polyshard internals."""
    from parallel.engine.data import packing

    mode = packing.mask_mode(packing.attention_of(model), precision, args.global_rows, args.seq)
    stream = packing.PackedStream(docs, args.seq, 0, lambda line: None, packing.vocab_of(model))
    collate, rows, out = packing.collate(mode), [], []
    for row in stream:
        rows.append(row)
        if len(rows) == args.global_rows:
            out.append(collate(rows))
            rows = []
            if len(out) == steps:
                return out
    raise SystemExit(f"--data {args.data}: its documents filled {len(out)} batches of "
                     f"{args.global_rows} rows of {args.seq} tokens; {steps} are needed")


def token_counts(timed: list[dict]) -> dict:
    """Tokens per global batch over the timed steps: every position fed, and the targets a loss
    counts (labels not -100; the model shifts them by one)."""
    fed = sum(b["input_ids"].numel() for b in timed) / len(timed)
    labels = [b.get("labels", b["input_ids"])[:, 1:] for b in timed]
    return {"tokens_per_step": fed, "target_tokens_per_step":
            sum(int((x != -100).sum()) for x in labels) / len(timed)}


def per_rank(engine, saves, grads_peak: int, counter, memory: dict | None) -> list[dict]:
    """Every rank's memory, communication and save figures, gathered (untimed, after the steps)."""
    held = engine.state_tensors()
    mine = {"saves": saves, "rank": engine.rank, "memory": memory,
            "params_bytes": held_bytes(held["params"]),
            "optimizer_bytes": held_bytes(held["optimizer"]), "grads_bytes": grads_peak,
            "rss_peak_bytes": peak_rss_bytes(), "comm": counter.snapshot(),
            "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else None}
    ranks = [None] * engine.world_size
    dist.all_gather_object(ranks, mine)
    return ranks


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
