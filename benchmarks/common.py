"""Shared by the native loops: the job's model, batches and timing, with no polyshard import (these
loops are the baseline `polyshard bench --vs-native` compares against). `--count` borrows polyshard's
step counter (parallel/tools/bench/counting.py), so both sides are counted by the same rule; timed
runs import nothing from polyshard."""

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext

import torch

SIZES = os.path.join(os.path.dirname(__file__), "..", "examples", "data", "toy_models.json")


def args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="toy:demo")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--global-rows", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stage", type=int, default=3, help="ZeRO stage (native_deepspeed); FSDP2: 3 "
                   "reshards after forward (FULL_SHARD), 2 keeps parameters (SHARD_GRAD_OP)")
    p.add_argument("--tp", type=int, default=1, help="FSDP2, DeepSpeed: tensor-parallel degree (the "
                   "innermost mesh dim; a TP group's ranks take the same rows)")
    p.add_argument("--sp", type=int, default=1, help="DeepSpeed: Ulysses sequence parallelism over N "
                   "ranks (inside tp's place: an sp group's ranks take the same rows)")
    p.add_argument("--ep", type=int, default=1, help="native_ep: experts split over N ranks (the "
                   "innermost of the data-parallel ranks)")
    p.add_argument("--pp", type=int, default=1, help="native_pipeline: pipeline stages over N "
                   "ranks (the outermost mesh dim: a pipeline's ranks take the same rows)")
    p.add_argument("--schedule", default="1f1b", help="native_pipeline: gpipe, 1f1b or "
                   "interleaved_1f1b (2 stages per rank)")
    p.add_argument("--microbatches", type=int, default=4, help="native_pipeline: pipeline "
                   "micro-batches per step")
    p.add_argument("--flatten", action="store_true", help="XLA FSDP v1: flatten_parameters")
    p.add_argument("--muon", action="store_true", help="FSDP2: torch.optim.Muon on the hidden "
                   "matrices (each gathered at an owner rank and scattered back), AdamW on the rest")
    p.add_argument("--fp8", action="store_true", help="FSDP2: float8 training as torchtitan's docs "
                   "write it (torchao's tensorwise Float8Linear but the head, float8 all-gather, "
                   "the scales precomputed after each optimizer step)")
    p.add_argument("--count", action="store_true", help="count collectives, host reads and store "
                   "calls of every step after the warm-up (not timed)")
    p.add_argument("--startup", action="store_true", help="stop after the first step and write the "
                   "wall-clock time it ended at (start-up to the first step: bench --startup)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def counter(a):
    if not a.count:
        return None
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from parallel.tools.bench.counting import StepCounter

    return StepCounter()


def config(name: str):
    """toy:SIZE (the sizes parallel/toy.py reads) or a Hugging Face config.json, as bench's --model."""
    from transformers import AutoConfig, LlamaConfig

    if not name.startswith("toy:"):
        return AutoConfig.from_pretrained(name, local_files_only=True, trust_remote_code=False)
    with open(SIZES) as f:
        sizes = json.load(f)
    fields = {**sizes["common"], **sizes[name.removeprefix("toy:")]}
    kind = fields.pop("model_type", None)  # the mixture-of-experts toys
    return AutoConfig.for_model(kind, **fields) if kind else LlamaConfig(**fields)


def model(name: str, seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = config(name)
    if type(cfg) is LlamaConfig:
        return LlamaForCausalLM(cfg).float()
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).float()


def batches(a):
    """The batches polyshard's bench cell draws (parallel/tools/parity/cell.global_batches)."""
    g = torch.Generator().manual_seed(a.seed + 1)
    vocab = config(a.model).vocab_size
    return [torch.randint(0, vocab, (a.global_rows, a.seq), generator=g)
            for _ in range(a.warmup + a.steps)]


IGNORE_INDEX = -100


def token_share(mean: torch.Tensor, labels: torch.Tensor, group=None) -> torch.Tensor:
    """torchtitan's loss normalisation (trainer.train_step): this rank's summed loss over the step's
    target tokens of every data-parallel rank, the global count summed on the device (one all-reduce,
    no host sync). HF's causal loss shifts inside the model, so the targets are labels[..., 1:]
    (torchtitan's labels come shifted). Summed over ranks it is the global batch's mean loss.
    `group`: the data-parallel ranks, where tensor-parallel ranks share rows."""
    local = (labels[..., 1:] != IGNORE_INDEX).sum()
    total = local.clone()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(total, group=group)
    return mean * local / total


def timed(step, ids, world: int, tp: int = 1) -> tuple[float, float]:
    """One step as a logging loop takes it: the step, then its loss summed over ranks (each returns
    its share; a TP (x SP) group's `tp` ranks the same one) and read back (so asynchronous devices
    have finished). (seconds, loss)."""
    start = time.perf_counter()
    loss = step(ids)
    if torch.distributed.is_initialized() and world > 1:
        torch.distributed.all_reduce(loss := loss.detach().clone())
    value = float(loss) / tp
    return time.perf_counter() - start, value


def run(a, step, rank: int, world: int):
    """`step(ids) -> this rank's share of the loss`; times each step with the loss read back, as
    polyshard does."""
    model_ranks = a.tp * a.sp  # a tp x sp block shares its rows; tp is the innermost dim
    # pp is the outermost: the ranks of one pipeline (world / pp apart) take the same rows
    per_stage = world // a.pp
    rows = a.global_rows // (per_stage // model_ranks)
    dp_rank = rank % per_stage // model_ranks
    times, losses, counting = [], [], counter(a)
    for i, ids in enumerate(batches(a)):
        mine = ids[dp_rank * rows:(dp_rank + 1) * rows]
        with counting.step() if counting and i >= a.warmup else nullcontext():
            elapsed, value = timed(step, mine, world, model_ranks)
        if a.startup:  # the first step has ended (its loss read back): that is start-up's end
            if rank == 0:
                with open(a.out, "w") as f:
                    json.dump({"first_step_end": time.time()}, f)
            return
        if i >= a.warmup:
            times.append(elapsed)
        losses.append(value)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"step_times": times, "losses": losses, "pid": os.getpid(), "world_size": world,
                       "counts": counting and [dict(c) for c in counting.steps]}, f)


def distributed_main(build):
    """A torch.distributed loop as a script: one process group (gloo on CPU, NCCL on GPUs), the
    whole job, then the group torn down."""
    import torch.distributed as dist

    a = args()
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    run(a, build(a, rank, world), rank, world)
    dist.destroy_process_group()
