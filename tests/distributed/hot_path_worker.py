"""What each steady-state step of polyshard's train_step pays (parallel/tools/bench/counting.py), on
one launch per backend family: for every case, WARMUP steps, then COUNTED steps counted one by one,
twice: reading the loss every step (as the loops in benchmarks/ do) and never reading it. Rank 0
writes {case: {"read": counts per step, "noread": counts per step}}."""

import argparse
import json
from contextlib import nullcontext

import torch
from parity_worker import global_batches

from parallel import create_engine, load_spec
from parallel.tools.bench.counting import StepCounter
from parallel.tools.parity.cell import optimizer_arg, prepare_kwargs
from parallel.toy import build_llama, llama_config

WARMUP, COUNTED = 2, 3


def counts(spec_dict: dict, rows: int, model: str = "tiny", optimizer: str = "adamw") -> dict:
    engine = create_engine(load_spec(spec_dict))
    torch.manual_seed(0)
    model = build_llama(llama_config(model))
    engine.prepare(model, optimizer_arg(optimizer, 1e-3), **prepare_kwargs(optimizer))
    batches = global_batches(2 * (WARMUP + COUNTED), 1, rows)
    mine = engine.samples_per_step
    out = {}
    for mode in ("read", "noread"):
        counter = StepCounter()
        for i, ids in enumerate(batches[:WARMUP + COUNTED] if mode == "read" else
                                batches[WARMUP + COUNTED:]):
            part = ids[engine.dp_rank * mine:(engine.dp_rank + 1) * mine]
            with counter.step() if i >= WARMUP else nullcontext():
                result = engine.train_step({"input_ids": part, "labels": part})
                if mode == "read":
                    result.loss  # noqa: B018 - the read a logging loop makes
        out[mode] = counter.per_step()
    # each case its own job: DeepSpeed keeps AutoTP's groups in module globals until its engine
    # closes, and the next DeepSpeed engine (a cp one) would find them (measured)
    engine.close()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="tiny", help="a toy model (parallel/toy.py): tiny, mixtral, ...")
    p.add_argument("--optimizer", default="adamw", help="adamw, or muon (Muon + AdamW)")
    args = p.parse_args()
    results = {name: counts(spec, args.rows, args.model, args.optimizer)
               for name, spec in json.load(open(args.cases)).items()}
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_rank() == 0:
        json.dump(results, open(args.out, "w"), indent=1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
