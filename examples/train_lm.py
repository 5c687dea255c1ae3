"""Train a small Llama-style model on byte-level text under whatever backend the spec names.

    polyshard launch configs/demo.yaml examples/train_lm.py --stop-at 30 --save runs/demo/ckpt
    polyshard launch configs/demo.yaml examples/train_lm.py --resume runs/demo/ckpt
"""

import argparse
import math

import torch
from rich.console import Console

from parallel import create_engine
from parallel.launch import current_spec
from parallel.toy import ByteDataset, build_llama, llama_config

parser = argparse.ArgumentParser()
parser.add_argument("--config", default="configs/demo.yaml", help="spec, when not launched by polyshard")
parser.add_argument("--steps", type=int, default=60, help="length of the schedule, in optimizer steps")
parser.add_argument("--stop-at", type=int, help="stop early at this step (then --save, and resume later)")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--model-size", default="demo", choices=["demo", "tiny"])
parser.add_argument("--save", help="checkpoint directory to write at the end")
parser.add_argument("--resume", help="checkpoint directory to continue from")
args = parser.parse_args()

# 1. The spec (passed by `polyshard launch`) decides backend, sharding, precision and topology.
spec = current_spec(default=args.config)
engine = create_engine(spec)
console = Console(quiet=not engine.is_main)

# 2. Model, optimizer and schedule. The engine builds the optimizer after sharding.
config = llama_config(args.model_size)
warmup = 5


def schedule(opt):
    cosine = lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * cosine(s))


def param_groups(named):
    """Weight decay on matrices only. `named` is the model as built (full shapes, original names) on
    every backend; polyshard maps the groups onto the sharded parameters."""
    return [{"params": [n for n, p in named if p.dim() >= 2]},
            {"params": [n for n, p in named if p.dim() < 2], "weight_decay": 0.0}]


model = engine.prepare(lambda: build_llama(config),
                       optimizer=(torch.optim.AdamW, {"lr": args.lr, "weight_decay": 0.1}),
                       scheduler=schedule, param_groups=param_groups)
with torch.device("meta"):  # count parameters without allocating them
    n_params = sum(p.numel() for p in build_llama(config).parameters())

# 3. Data: a distributed loader whose position is part of the checkpoint.
dataset = ByteDataset(seq_len=128)
loader = engine.dataloader(dataset)

if args.resume:
    engine.load(args.resume)
    console.print(f"[bold]resumed[/] from {args.resume} at step {engine.step}")
console.print(f"{spec.backend} ({spec.shard}, {spec.precision}) on {engine.world_size} rank(s), "
              f"{n_params / 1e6:.2f}M parameters, {len(dataset)} samples of 128 bytes")

# 4. The loop: one train_step is one optimizer step over micro_batch_size x grad_accum_steps samples.
losses, lrs = [], []
batches = iter(loader)
# The bar is live in a terminal or notebook and a plain line every tracking.every steps in a log;
# the spec's `tracking:` section sends the same metrics to TensorBoard / MLflow / wandb / JSON lines.
stop = args.stop_at or args.steps
with engine.progress_bar(total=stop) as bar:
    while engine.step < stop:
        try:
            batch = next(batches)
        except StopIteration:  # next epoch
            batches = iter(loader)
            continue
        result = engine.train_step(batch)
        losses.append(result.loss)
        lrs.append(result.lr)
        bar.update(result)

if losses:
    console.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over steps "
                  f"{engine.step - len(losses) + 1}..{engine.step} "
                  f"({losses[-1] / math.log(2):.2f} bits/byte), lr {lrs[0]:.1e} -> {lrs[-1]:.1e}")
if args.save:
    path = engine.save(args.save)
    console.print(f"saved step {engine.step} to {path}")
engine.close()
