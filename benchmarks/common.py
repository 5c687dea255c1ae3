"""Shared by the native loops: the job's model, batches and timing, with no polyshard import (these
loops are the baseline `polyshard bench --vs-native` compares against)."""

import argparse
import json
import os
import time

import torch

SIZES = os.path.join(os.path.dirname(__file__), "..", "examples", "data", "toy_models.json")


def args():
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
    p.add_argument("--out", required=True)
    return p.parse_args()


def model(name: str, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with open(SIZES) as f:  # the same sizes parallel/toy.py reads
        sizes = json.load(f)
    config = LlamaConfig(**sizes["common"], **sizes[name.removeprefix("toy:")])
    return LlamaForCausalLM(config).float()


def batches(a, vocab=256):
    g = torch.Generator().manual_seed(a.seed + 1)
    return [torch.randint(0, vocab, (a.global_rows, a.seq), generator=g)
            for _ in range(a.warmup + a.steps)]


def run(a, step, rank: int, world: int):
    """`step(ids) -> loss tensor`; times each step with the loss read back, as polyshard does."""
    rows = a.global_rows // world
    times, losses = [], []
    for i, ids in enumerate(batches(a)):
        mine = ids[rank * rows:(rank + 1) * rows]
        start = time.perf_counter()
        loss = step(mine)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(loss := loss.detach().clone())
            loss /= world
        value = float(loss)
        if i >= a.warmup:
            times.append(time.perf_counter() - start)
        losses.append(value)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"step_times": times, "losses": losses, "pid": os.getpid()}, f)
