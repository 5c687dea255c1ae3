"""A 2-rank FSDP2 job that trains one step and checkpoints into --root (phase save), or resumes from
--root's latest checkpoint (phase resume: checkpoint.resume auto, as after a restart)."""

import argparse

import torch

from parallel import create_engine, load_spec
from parallel.toy import build_llama, llama_config

p = argparse.ArgumentParser()
p.add_argument("--phase", choices=["save", "resume"], required=True)
p.add_argument("--root", required=True)
args = p.parse_args()
engine = create_engine(load_spec({"topology": {"procs_per_node": 2}, "micro_batch_size": 2,
                                  "checkpoint": {"dir": args.root, "every": 1, "resume": "auto"}}))
torch.manual_seed(0)
engine.prepare(build_llama(llama_config("tiny")), (torch.optim.AdamW, {"lr": 1e-3}))
if args.phase == "resume":
    engine.resume()
ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(engine.rank))
engine.train_step({"input_ids": ids, "labels": ids})
engine.maybe_save()
engine.close()
