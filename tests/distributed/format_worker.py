"""Loads tests/fixtures/ckpt-v1 (format version 1, written by FSDP2 on one rank) into FSDP2 and ZeRO-3
on this launch's ranks and takes the fixture's step 3; rank 0 writes the losses to --out."""

import argparse
import json
from pathlib import Path

import torch

from parallel import create_engine, load_spec
from parallel.toy import build_llama, llama_config


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fixture", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    ref = json.loads(Path(a.fixture + ".json").read_text())
    g = torch.Generator().manual_seed(ref["batch_seed"])
    batch = [torch.randint(0, 256, (ref["rows"], ref["seq"]), generator=g) for _ in range(3)][2]
    out = {}
    for name, spec in {"fsdp2": {"backend": "fsdp"},
                       "zero3": {"backend": "deepspeed", "shard": "full"}}.items():
        engine = create_engine(load_spec({**spec, "micro_batch_size": 2,
                                          "topology": {"procs_per_node": 2}}))
        torch.manual_seed(123)  # other initial weights: the checkpoint must replace them
        engine.prepare(build_llama(llama_config("tiny")),
                       (torch.optim.AdamW, {"lr": ref["lr"], "weight_decay": ref["weight_decay"]}))
        manifest = engine.load(a.fixture)
        mine = batch[engine.dp_rank * 2:(engine.dp_rank + 1) * 2]
        out[name] = {"step": engine.step, "format": manifest["format_version"],
                     "loss": engine.train_step({"input_ids": mine, "labels": mine}).loss}
        rank = engine.rank  # no close() between engines: one process group for the launch
    if rank == 0:
        Path(a.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
