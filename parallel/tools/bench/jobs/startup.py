"""The job `polyshard bench --startup` times under `polyshard launch`: engine, the bench's model, one
step; then the wall-clock time that step ended at (benchmarks/ loops write the same with --startup)."""

import argparse
import json
import time

import torch

from parallel import create_engine
from parallel.launch import current_spec
from parallel.toy import build_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="toy:demo")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    engine = create_engine(current_spec())
    torch.manual_seed(0)
    model = engine.prepare(lambda: build_model(a.model), (torch.optim.AdamW, {"lr": 1e-3}))
    vocab = getattr(getattr(model, "config", None), "vocab_size", 256)
    ids = torch.randint(0, vocab, (engine.samples_per_step, a.seq))
    engine.train_step({"input_ids": ids, "labels": ids}).loss  # noqa: B018 - read: the step ended
    if engine.is_main:
        with open(a.out, "w") as f:
            json.dump({"first_step_end": time.time()}, f)
    engine.close()


if __name__ == "__main__":
    main()
