"""Memory of one training step against sequence length, with and without `sequence.loss_tile`, in one
process on this host (docs/long-sequences.md holds the table it printed).

    python benchmarks/long_rows.py [--seqs 1024,2048,4096,8192] [--vocab 32000] [--tile 1024]

The demo Llama (4 layers, hidden 256) with a Llama-2-sized vocabulary, one row, fp32, sdpa: the most
tensor bytes held during forward + backward (parallel/tools/bench/measure.py's step_peak_bytes: CUDA's
allocator where there is one, torch.profiler's allocation events on CPU) beside what `polyshard plan`
predicts for the activations and logits (parallel/tools/plan.py: activations).
"""

from __future__ import annotations

import argparse

import torch

from parallel.engine.model.tiled_loss import apply_tiled_loss
from parallel.tools.bench.measure import step_peak_bytes
from parallel.tools.plan import activations
from parallel.toy import build_llama, llama_config

MiB = 2 ** 20


def peak(seq: int, vocab: int, tile: int | None) -> tuple[float, float]:
    torch.manual_seed(0)
    model = build_llama(llama_config("demo", vocab_size=vocab))
    tiled = apply_tiled_loss(model, tile, has_loss_fn=False)
    ids = torch.randint(0, vocab, (1, seq))
    batch = {"input_ids": ids, "labels": ids}

    def step():
        loss = tiled.forward(model, batch)[1] if tiled else model(**batch).loss
        loss.backward()

    step()  # warm: gradients exist, as in every step after the first
    measured = step_peak_bytes(step)
    cfg = {**model.config.to_dict(), "_attn_implementation": model.config._attn_implementation}
    planned = activations(cfg, 1, seq, "fp32", False, loss_tile=tile)
    return measured["peak"] - measured["boundary"], planned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tile", type=int, default=1024)
    args = ap.parse_args()
    print(f"| tokens | step peak above the boundary, MiB (plan) | with loss_tile {args.tile} "
          "(plan) | saved |")
    print("|---|---|---|---|")
    for seq in (int(s) for s in args.seqs.split(",")):
        whole, whole_plan = peak(seq, args.vocab, None)
        tiled, tiled_plan = peak(seq, args.vocab, args.tile)
        print(f"| {seq:,} | {whole / MiB:,.0f} ({whole_plan / MiB:,.0f}) | {tiled / MiB:,.0f} "
              f"({tiled_plan / MiB:,.0f}) | {1 - tiled / whole:.0%} |", flush=True)


if __name__ == "__main__":
    main()
