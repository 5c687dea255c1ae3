"""XLA FSDP v1 sharded checkpoints in (`polyshard ckpt import xla`): `*rank-R-of-N*` files holding
`model`, `shard_metadata` and optionally `optimizer`."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path


from parallel.checkpoint.importers import CheckpointImportError, named_groups
from parallel.checkpoint.portable import clean_name
from parallel.checkpoint.optim_state import shared_step
from parallel.checkpoint.safe import torch_load

RANK_FILE = re.compile(r"rank[-_]?(\d+)(?:-of-(\d+))?")


def read_xla(src: Path, trust: bool = False):
    """XLA FSDP v1 shards: consolidated by torch_xla's own consolidate_sharded_state_dicts, applied to
    the weights and to each optimizer entry (which is sharded exactly like its parameter)."""
    from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

    files = sorted((f for f in src.iterdir() if f.is_file() and RANK_FILE.search(f.name)),
                   key=lambda f: int(RANK_FILE.search(f.name).group(1)))
    if not files:
        raise CheckpointImportError(f"{src}: no files named like *rank-R-of-N* (XLA FSDP shard files)")
    shards = [torch_load(f, "an XLA FSDP shard file", trust=trust) for f in files]  # data only
    meta = shards[0]["shard_metadata"]
    with contextlib.redirect_stdout(io.StringIO()):
        model = consolidate_sharded_state_dicts([s["model"] for s in shards], meta)
    state = {"model": {clean_name(k): v for k, v in model.items()}}
    optims = [s.get("optimizer", s.get("optim")) for s in shards]
    if optims[0] is not None:
        # Optimizer entries are indexed like parameters(), whose order is the state dict's.
        shard_names = [k for k in shards[0]["model"] if "_fsdp_shard" in k]
        keys = {k for entry in optims[0]["state"].values() for k in entry if k != "step"}
        with contextlib.redirect_stdout(io.StringIO()):
            per_key = {k: consolidate_sharded_state_dicts(
                [{name: o["state"][i][k] for i, name in enumerate(shard_names)} for o in optims], meta)
                for k in keys}
        names = [clean_name(n) for n in next(iter(per_key.values()))] if per_key else []
        entries = {n: {k: per_key[k][raw] for k in keys}
                   for n, raw in zip(names, next(iter(per_key.values())))} if per_key else {}
        step = shared_step(optims[0]["state"].values())
        for entry in entries.values():
            if step is not None:
                entry["step"] = step
        state["optim"] = {"state": entries,
                          "param_groups": named_groups(optims[0]["param_groups"], [names])}
    return state, None, meta["world_size"]
