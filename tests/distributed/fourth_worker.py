"""2 ranks: train 3 steps on backend A from the seed's weights, save; then (phase load) a fresh engine
on backend B over other weights loads it and trains steps 4-5. Rank 0 writes the losses.

    fourth_worker.py PHASE BACKEND CKPT OUT
"""

import json
import sys

import fourth_backend
import torch

from parallel import create_engine, load_spec, registry
from parallel.toy import build_llama, llama_config


def main():
    phase, backend, ckpt, out = sys.argv[1:5]
    registry.register(fourth_backend.DESCRIPTOR)
    spec = load_spec({"backend": backend, "micro_batch_size": 2, "topology": {"procs_per_node": 2},
                      "seed": 0, "shard": "none" if backend == "replica" else "full"})
    engine = create_engine(spec)
    torch.manual_seed(0 if phase == "save" else 7)
    engine.prepare(build_llama(llama_config("tiny")), (torch.optim.AdamW, {"lr": 1e-3}))
    ids = torch.randint(0, 256, (5, 4, 16), generator=torch.Generator().manual_seed(1))
    mine = slice(engine.dp_rank * 2, engine.dp_rank * 2 + 2)
    if phase == "load":
        engine.load(ckpt)
    steps = range(3) if phase == "save" else range(3, 5)
    losses = [engine.train_step({"input_ids": ids[s, mine], "labels": ids[s, mine]}).loss
              for s in steps]
    if phase == "save":
        engine.save(ckpt)
    if engine.rank == 0:
        json.dump(losses, open(out, "w"))
    engine.close()


if __name__ == "__main__":
    main()
