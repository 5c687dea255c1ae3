"""Several native jobs in one launch: one process group, then each job as its script's own `main` runs
it (`build`, then `common.run`), one after another. The loops are unchanged; only their start-up is
shared (tests/distributed/test_hot_path.py counts eleven loops' steps for the price of one launch).

    torchrun --nproc-per-node 2 benchmarks/cases.py --cases CASES.json --out OUT.json

CASES.json: {name: [script, its arguments...]} (each with its own --out); OUT.json: {name: what that
job wrote}.
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the loops import their shared `common`

import common  # noqa: E402


def load(script: str):
    spec = importlib.util.spec_from_file_location(f"native_{Path(script).stem}", HERE / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if not dist.is_initialized():  # (a test harness may run this in a process group of its own)
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (script, *argv) in json.loads(Path(a.cases).read_text()).items():
        job, module = common.args(argv), load(script)
        common.run(job, module.build(job, rank, world), rank, world)
        teardown = getattr(module, "teardown", None)  # process-wide state a loop leaves behind
        if teardown is not None:
            teardown()
        if rank == 0:
            out[name] = json.loads(Path(job.out).read_text())
    if rank == 0:
        Path(a.out).write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
