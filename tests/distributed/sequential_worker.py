"""Jobs one after another in one process, each closed before the next (a sweep, a notebook kernel):
every job must join a fresh process group and match one process. Rank 0 writes each job's largest
loss difference from the single-process run, or its error, to --out."""

import argparse
import json
import os
import traceback

import torch
from parity_worker import global_batches, optimizer_arg, rank_slice

from parallel import create_engine, load_spec
from parallel.tools.parity.cell import one_process
from parallel.toy import build_llama, llama_config


def job(spec_dict: dict) -> tuple[float, int]:
    spec = load_spec(spec_dict)
    engine = create_engine(spec)
    rows = engine.samples_per_step
    batches = global_batches(2, engine.dp_size, rows)
    torch.manual_seed(spec.seed)
    ref = [r["loss"] for r in one_process(build_llama(llama_config("tiny")), optimizer_arg("adamw"),
                                           batches, spec.grad_clip)]
    torch.manual_seed(spec.seed)
    engine.prepare(build_llama(llama_config("tiny")), optimizer_arg("adamw"))
    losses = [engine.train_step(rank_slice(b, engine.dp_rank, rows)).loss for b in batches]
    rank = engine.rank
    engine.close()  # destroys the process group: the next job starts from nothing
    return max(abs(a - b) for a, b in zip(losses, ref)), rank


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results = {}
    # the launcher's rank, known before any job: a rank whose first job fails must not write
    rank = int(os.environ.get("RANK", "0"))
    for name, spec in json.load(open(args.jobs)).items():
        try:
            results[name], _ = job(spec)
        except Exception:
            results[name] = traceback.format_exc()[-3000:]
            break  # the process group may be gone: later jobs would only hang
    if rank == 0:
        json.dump(results, open(args.out, "w"))


if __name__ == "__main__":
    main()
