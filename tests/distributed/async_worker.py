"""checkpoint.async_save on every case --cases names (2 ranks): steps 1-3, async save, steps 4-5
while it is written, a second async save (waits for the first); then a fresh engine loads the step-3
checkpoint and takes steps 4-5 again. Also times how long `save` blocks, sync and async, on the same
state, and (a writer process) kills every rank's writer while a save is written. Rank 0 writes
everything to --out."""

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from parallel import create_engine, load_spec
from parallel.checkpoint.format.manifest import verify_checkpoint
from parallel.checkpoint.background.writer import WriterDied
from parallel.toy import build_llama, llama_config

def engine_for(spec, seed):
    engine = create_engine(load_spec(spec))
    torch.manual_seed(seed)
    engine.prepare(build_llama(llama_config("demo")), (torch.optim.AdamW, {"lr": 1e-3}))
    return engine


def steps(engine, batches):
    out = []
    for b in batches:
        mine = b[engine.dp_rank * 2:(engine.dp_rank + 1) * 2]
        out.append(engine.train_step({"input_ids": mine, "labels": mine}).loss)
    return out


def timed_save(engine, path, async_save):
    dist.barrier()
    start = time.perf_counter()
    engine.save(path, async_save=async_save)
    blocking = time.perf_counter() - start
    engine.wait_for_save()
    dist.barrier()
    return blocking, time.perf_counter() - start


def crash_while_writing(engine, root):
    """Every rank's writer process SIGKILLed right after `save` returned, its write in flight: each
    rank's wait raises, `latest` stays, later async saves are refused and a synchronous one works."""
    engine.save(root / "crash")
    os.kill(engine.checkpoints.saver.writer_pid, signal.SIGKILL)
    out = {}
    for what, action in (("wait", engine.wait_for_save),
                         ("next", lambda: engine.save(root / "refused"))):
        try:
            action()
            out[what] = None
        except WriterDied as err:
            out[what] = str(err)
    dist.barrier()
    out["latest"] = (root / "latest").read_text().strip()
    out["crash_dir"] = (root / "crash").exists()
    engine.save(root / "sync-after", async_save=False)
    out["latest_after_sync"] = (root / "latest").read_text().strip()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", required=True, help="JSON file: {name: spec}")
    a = p.parse_args()
    root, out = Path(a.root), {}
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 256, (4, 32), generator=g) for _ in range(5)]
    for name, spec in json.loads(Path(a.cases).read_text()).items():
        a_ = engine_for({**spec, "checkpoint": {**spec.get("checkpoint", {}), "async_save": True}}, 0)
        first = steps(a_, batches[:3])
        a_.save(root / name / "step-3")  # async: returns after staging
        first += steps(a_, batches[3:])  # trains while step-3 is written
        a_.save(root / name / "step-5")  # waits for step-3 to be published first
        a_.wait_for_save()
        sync = [timed_save(a_, root / name / f"sync-{i}", False) for i in range(2)]
        background = [timed_save(a_, root / name / f"async-{i}", True) for i in range(2)]
        latest = (root / name / "latest").read_text().strip()
        crash = crash_while_writing(a_, root / name) if a_.checkpoints.saver.writer_pid else None
        a_.close()
        b = engine_for(spec, 1)
        manifest = b.load(root / name / "step-3")
        again = steps(b, batches[3:])
        if b.rank == 0:
            verify_checkpoint(root / name / "step-5")
            out[name] = {"losses": first, "resumed": again, "step": manifest["step"],
                         "latest": latest, "crash": crash,
                         "sync_save_s": [s[0] for s in sync],
                         "async_blocking_s": [s[0] for s in background],
                         "async_total_s": [s[1] for s in background]}
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
