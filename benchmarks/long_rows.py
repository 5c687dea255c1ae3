"""Memory of one training step against sequence length, with and without `sequence.loss_tile`, in one
process on this host (docs/long-sequences.md holds the table it printed).

    python benchmarks/long_rows.py [--seqs 1024,2048,4096,8192] [--vocab 32000] [--tile 1024]
    torchrun --nproc-per-node 2 benchmarks/long_rows.py --cp 2 [--seqs ...]

The second form measures context parallelism (topology.cp): one rank's step peak through the engine
(FSDP2, 2 gloo ranks) at cp 1 (each rank its own row) and at cp N (each rank 1/N of one row).

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


def engine_peak(seq: int, vocab: int, tile: int | None, cp: int, world: int) -> tuple[float, float]:
    """One rank's step peak above the boundary through the engine, and plan's activations."""
    from parallel import create_engine, load_spec

    spec = load_spec({"backend": "fsdp", "micro_batch_size": 1, "sequence": {"loss_tile": tile},
                      "topology": {"procs_per_node": world, "cp": cp}})
    engine = create_engine(spec)
    torch.manual_seed(0)
    engine.prepare(build_llama(llama_config("demo", vocab_size=vocab, attn_implementation="sdpa")),
                   (torch.optim.SGD, {"lr": 1e-3}))
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(engine.dp_rank))

    def step():
        engine.train_step({"input_ids": ids, "labels": ids})

    step()
    measured = step_peak_bytes(step)
    cfg = {**llama_config("demo", vocab_size=vocab).to_dict(), "_attn_implementation": "sdpa"}
    planned = activations(cfg, 1, seq, "fp32", False, loss_tile=tile, cp=cp)
    engine.close()
    return measured["peak"] - measured["boundary"], planned


def cp_table(args) -> None:
    import os

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if rank == 0:
        print(f"| tokens per row | cp 1: one rank's step peak, MiB (plan) | cp {args.cp} (plan) | "
              "saved |")
        print("|---|---|---|---|")
    for seq in (int(s) for s in args.seqs.split(",")):
        one, one_plan = engine_peak(seq, args.vocab, args.tile, 1, world)
        split, split_plan = engine_peak(seq, args.vocab, args.tile, args.cp, world)
        if rank == 0:
            print(f"| {seq:,} | {one / MiB:,.0f} ({one_plan / MiB:,.0f}) | {split / MiB:,.0f} "
                  f"({split_plan / MiB:,.0f}) | {1 - split / one:.0%} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tile", type=int, default=1024)
    ap.add_argument("--cp", type=int, default=1, help="under torchrun: cp 1 against cp N")
    args = ap.parse_args()
    if args.cp > 1:
        cp_table(args)
        return
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
