"""A training loop started by `polyshard launch` with real faults injected (SIGKILL, a stall):

  --kill-step K --kill-rank R   rank R SIGKILLs itself right after step K, first attempt only
                                (TORCHELASTIC_RESTART_COUNT == 0): torchrun restarts every worker
  --kill-in-save K              rank R SIGKILLs itself inside the save of step K, after writing its
                                own files and before the checkpoint is complete
  --stall-step K                rank R sleeps 120 s before step K (its peers time out)
  --alone-step K                after step K, rank R runs a collective of its own (an all_reduce
                                between steps, as a reload on one rank does) while the others
                                sleep 20 s outside any collective
  --bad-batch-step K            rank R's batch for step K has no labels (BatchError on that rank)
  --signal-step K               rank R (or every rank with --kill-rank -1) sends itself SIGTERM right
                                after step K, first launch only (a preemption notice); K = 0:
                                during start-up, before the first step
  --signal-in-save K            rank R sends itself SIGTERM inside the save of step K, and again
                                after step K + 1 (a signal during a save, and a second signal)
  --found FILE                  on a restart (attempt >= 1), rank 0 writes what it finds in
                                checkpoint.dir before resuming: `latest` and any partial directory

The loop is the one a user writes: engine.resume() (checkpoint.resume: auto), train_step,
engine.maybe_save() every checkpoint.every steps. Rank 0 appends every step's loss to --log.

  --references FILE             no faults: run every spec of FILE ({name: spec}) uninterrupted in
                                this one launch (the reference losses of many cases for the price
                                of one start-up); rank 0 writes {name: losses} to --out
  --preempt FILE                every case of FILE ({name: {"spec", "who"}}) in this one launch:
                                its uninterrupted losses, then a run in which rank `who` (-1: every
                                rank) sends itself SIGTERM after step 3 (the engine agrees, saves and
                                raises Preempted, exit code 85), then a fresh engine that resumes
                                from `latest` (checkpoint.resume: auto) and finishes; rank 0 writes
                                {name: {reference, preempted, resumed, latest, code, message}}
"""

import argparse
import json
import os
import signal
import time

import torch

from pathlib import Path

from parallel import create_engine, load_spec
from parallel.launch.torchrun import current_spec
from parallel.toy import build_llama, llama_config


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, seq=16):
        g = torch.Generator().manual_seed(7)
        self.data = torch.randint(0, 256, (n, seq), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def start(spec):
    engine = create_engine(spec)
    torch.manual_seed(spec.seed)
    engine.prepare(build_llama(llama_config("tiny")), (torch.optim.AdamW, {"lr": 1e-2}))
    return engine, engine.dataloader(Tokens())


def references(path, steps, log):
    """The uninterrupted losses of every spec in `path`, one engine after another (no close
    between them: one process group for the launch)."""
    out = {}
    for name, data in json.loads(Path(path).read_text()).items():
        engine, loader = start(load_spec(data))
        engine.resume()
        losses = []
        while engine.step < steps:
            for batch in loader:
                losses.append(engine.train_step(batch).loss)
                engine.maybe_save()
                if engine.step >= steps:
                    break
        out[name] = losses
    if engine.is_main:
        Path(log).write_text(json.dumps(out))


def train(engine, loader, steps, after=lambda result: None, losses=None) -> list[float]:
    """The user's loop: train_step, then maybe_save, until `steps`; the losses, appended to
    `losses` as they come (they survive a Preempted raised mid-loop)."""
    losses = [] if losses is None else losses
    while engine.step < steps:
        for batch in loader:
            result = engine.train_step(batch)
            losses.append(result.loss)
            after(result)
            engine.maybe_save()
            if engine.step >= steps:
                break
    return losses


def preempt(path, steps, log):
    """Every case of `path` in this launch: uninterrupted, preempted after step 3, resumed."""
    from parallel.engine.watch.preempt import Preempted

    out = {}
    for name, case in json.loads(Path(path).read_text()).items():
        data = case["spec"]
        root = Path(data["checkpoint"]["dir"])
        reference = {**data, "checkpoint": {**data["checkpoint"], "dir": f"{root}-reference"}}
        engine, loader = start(load_spec(reference))
        row = {"reference": train(engine, loader, steps)}
        engine, loader = start(load_spec(data))
        signalled = case["who"] in (engine.rank, -1)

        def notice(result):
            if signalled and result.step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # caught: the engine decides with its peers

        row["first"] = []
        try:
            train(engine, loader, steps, notice, row["first"])
            row["code"] = 0
        except Preempted as stop:
            row.update(code=stop.code, message=str(stop), latest=(root / "latest").read_text().strip())
        row["preempted"] = engine.step
        engine, loader = start(load_spec(data))  # the requeued job: resume: auto from `latest`
        engine.resume()
        row["start"] = engine.step
        row["resumed"] = train(engine, loader, steps)
        out[name] = row
    if engine.is_main:
        Path(log).write_text(json.dumps(out))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--references")
    p.add_argument("--preempt")
    p.add_argument("--out", help="--references: where the losses go")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--log")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds after each step (a slow job)")
    p.add_argument("--found", help="a restart's view of checkpoint.dir, written by rank 0")
    for flag in ("--kill-step", "--kill-in-save", "--stall-step", "--alone-step", "--bad-batch-step",
                 "--signal-step", "--signal-in-save"):
        p.add_argument(flag, type=int)
    args = p.parse_args()
    if args.references:
        return references(args.references, args.steps, args.out)
    if args.preempt:
        return preempt(args.preempt, args.steps, args.out)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    spec = current_spec()
    engine, loader = start(spec)
    faulty = args.kill_rank in (engine.rank, -1) and attempt == 0
    fresh = not (spec.checkpoint.dir and os.path.exists(os.path.join(spec.checkpoint.dir, "latest")))
    # faults inside a save: the checkpointer's writer of the model and optimizer state, wrapped
    if faulty and args.kill_in_save:
        write = engine.checkpoints.write

        def write_then_die(tmp):
            write(tmp)
            if engine.step == args.kill_in_save:
                die()  # this rank's shards are on disk; the manifest never will be
        engine.checkpoints.write = write_then_die
    if faulty and args.signal_in_save:
        write = engine.checkpoints.write

        def signal_while_writing(tmp):  # the handler only sets a flag: this save completes
            if engine.step == args.signal_in_save:
                os.kill(os.getpid(), signal.SIGTERM)
            write(tmp)
        engine.checkpoints.write = signal_while_writing
    if args.found and attempt > 0 and engine.is_main:
        root = Path(spec.checkpoint.dir)
        latest = root / "latest"
        Path(args.found).write_text(json.dumps({
            "attempt": attempt, "latest": latest.read_text().strip() if latest.is_file() else None,
            "partial": sorted(p.name for p in root.glob(".*.partial"))}))
    engine.resume()
    if faulty and fresh and args.signal_step == 0:
        os.kill(os.getpid(), signal.SIGTERM)  # during start-up, before any step
    while engine.step < args.steps:
        for batch in loader:
            if faulty and engine.step + 1 == args.stall_step:
                time.sleep(120)
            if faulty and engine.step + 1 == args.bad_batch_step:
                batch.pop("labels")
            result = engine.train_step(batch)
            if engine.is_main:
                with open(args.log, "a") as f:
                    f.write(json.dumps({"step": result.step, "loss": result.loss,
                                        "attempt": attempt}) + "\n")
            if faulty and result.step == args.kill_step:
                die()
            if faulty and fresh and result.step == args.signal_step:
                os.kill(os.getpid(), signal.SIGTERM)  # caught: the engine decides with its peers
            if faulty and fresh and args.signal_in_save and result.step == args.signal_in_save + 1:
                os.kill(os.getpid(), signal.SIGTERM)  # a second signal: still one checkpoint
            engine.maybe_save()
            if args.alone_step and result.step == args.alone_step:
                if faulty:  # the user's own collective, entered by this rank alone
                    torch.distributed.all_reduce(torch.ones(1))
                else:
                    time.sleep(20)
            time.sleep(args.sleep)
            if engine.step >= args.steps:
                break
    engine.close()


if __name__ == "__main__":
    main()
