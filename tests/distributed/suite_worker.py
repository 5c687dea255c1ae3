"""Several workers' jobs in one launch (tests/distributed/shared.py): each job is a worker module of this
directory run as its own `main()` would run it (its command line, its own --out), one after another in
these processes, over one process group. Between jobs nothing of a job is left that the next could
see: the process group stays (a worker's destroy_process_group at its end is held until the last
job), the signal handlers a job's engines installed (preemption) are put back, the collector runs,
transformers forgets a ZeRO-3 configuration a job left registered, DeepSpeed the groups and AutoTP
mode its engines left (what closing them releases: parallel/engine's DeepSpeed `_release` and
`_destroy_process_group`), and a barrier keeps the ranks together. A job that raises ends the
launch (its peers would wait in the next
job's collectives): the jobs after it report no output.

    torchrun --nproc-per-node N suite_worker.py --jobs JOBS.json
"""

import argparse
import gc
import importlib
import importlib.util
import json
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # the workers and their helpers


SIGNALS = [getattr(signal, n) for n in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")]


def between_jobs(handlers: dict) -> None:
    for signum, handler in handlers.items():  # a job's preemption handlers end with it
        signal.signal(signum, handler)
    if "transformers.integrations.deepspeed" in sys.modules:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # a ZeRO-3 engine a job did not close registered one
    if "deepspeed.utils.groups" in sys.modules:  # what closing the job's DeepSpeed engines releases
        from deepspeed.module_inject.layers import set_autotp_mode
        from deepspeed.utils import groups

        groups._release_process_group_references(group=None)  # AutoTP's groups, its mpu
        set_autotp_mode(training=False)
    gc.collect()
    if dist.is_initialized():
        dist.barrier()


def load(worker: str):
    """A worker module of this directory by name, or any script by its path (benchmarks/cases.py)."""
    if not worker.endswith(".py"):
        return importlib.import_module(worker)
    spec = importlib.util.spec_from_file_location(Path(worker).stem, worker)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", required=True)
    a = p.parse_args()
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None  # held until the last job
    timings, handlers = [], {s: signal.getsignal(s) for s in SIGNALS}
    try:
        for job in json.loads(Path(a.jobs).read_text()):
            start = time.perf_counter()
            sys.argv = [job["worker"], *job["argv"]]
            load(job["worker"]).main()
            between_jobs(handlers)
            timings.append((job["worker"], round(time.perf_counter() - start, 1)))
    finally:
        dist.destroy_process_group = destroy
    if dist.is_initialized():
        rank = dist.get_rank()
        dist.destroy_process_group()
    else:
        rank = 0
    if rank == 0:  # beside the jobs file: where the shared launches' time goes
        Path(f"{a.jobs}.seconds.json").write_text(json.dumps(timings))
        print(f"suite_worker: {timings}", file=sys.stderr)


if __name__ == "__main__":
    main()
