"""A training loop started by `polyshard launch` with real faults injected (SIGKILL, a stall):

  --kill-step K --kill-rank R   rank R SIGKILLs itself right after step K, first attempt only
                                (TORCHELASTIC_RESTART_COUNT == 0): torchrun restarts every worker
  --kill-in-save K              rank R SIGKILLs itself inside the save of step K, after writing its
                                own files and before the checkpoint is complete
  --stall-step K                rank R sleeps 120 s before step K (its peers time out)

The loop is the one a user writes: engine.resume() (checkpoint.resume: auto), train_step,
engine.maybe_save() every checkpoint.every steps. Rank 0 appends every step's loss to --log.
"""

import argparse
import json
import os
import signal
import time

import torch

from parallel import create_engine
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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--log", required=True)
    p.add_argument("--kill-rank", type=int, default=1)
    for flag in ("--kill-step", "--kill-in-save", "--stall-step"):
        p.add_argument(flag, type=int)
    args = p.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    spec = current_spec()
    engine = create_engine(spec)
    torch.manual_seed(spec.seed)
    engine.prepare(build_llama(llama_config("tiny")), (torch.optim.AdamW, {"lr": 1e-2}))
    loader = engine.dataloader(Tokens())
    faulty = engine.rank == args.kill_rank and attempt == 0
    if faulty and args.kill_in_save:
        write = engine._save_model_optim

        def write_then_die(tmp):
            write(tmp)
            if engine.step == args.kill_in_save:
                die()  # this rank's shards are on disk; the manifest never will be
        engine._save_model_optim = write_then_die
    engine.resume()
    while engine.step < args.steps:
        for batch in loader:
            if faulty and engine.step + 1 == args.stall_step:
                time.sleep(120)
            result = engine.train_step(batch)
            if engine.is_main:
                with open(args.log, "a") as f:
                    f.write(json.dumps({"step": result.step, "loss": result.loss,
                                        "attempt": attempt}) + "\n")
            if faulty and result.step == args.kill_step:
                die()
            engine.maybe_save()
            if engine.step >= args.steps:
                break
    engine.close()


if __name__ == "__main__":
    main()
