"""XLA FSDP v1 rank files as torch_xla would have written them at another world size, for tests on
this host, whose PJRT CPU client runs XLA FSDP v1 at world size 1 only.

XlaFullyShardedDataParallel._get_shard flattens each sharded tensor (a parameter, or a flat
parameter of several), pads it to a multiple of world * _shard_size_multiple and gives rank r the
r-th of `world` equal pieces; with shard_param_on_dim_0 it pads and splits rows instead. Optimizer
moments are shaped like their shards. `reshard` rebuilds each tensor from the ranks given (their
shards concatenated and cut to the true length, as consolidate_sharded_state_dicts does) and cuts it
again; torch_xla's consolidation of the result is the test's check that it did so rightly."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def reshard(saved: list[dict], world: int, multiple: int = 1) -> list[dict]:
    """`saved`: every rank's file contents ({model, shard_metadata[, optimizer]}), in rank order."""
    meta = saved[0]["shard_metadata"]
    out = [{"model": {}, "shard_metadata": {**meta, "world_size": world, "rank": r}}
           for r in range(world)]
    sharded = [k for k in saved[0]["model"] if _sizes(k, meta) is not None]
    for key, value in saved[0]["model"].items():
        pieces = _split(key, [s["model"][key] for s in saved], meta, world, multiple) \
            if key in sharded else [value.clone()] * world
        for r in range(world):
            out[r]["model"][key] = pieces[r]
    if "optimizer" in saved[0]:
        for r in range(world):
            out[r]["optimizer"] = {"state": {}, "param_groups": saved[0]["optimizer"]["param_groups"]}
        for pos, entry in saved[0]["optimizer"]["state"].items():
            for name, value in entry.items():
                shaped = torch.is_tensor(value) and value.shape == saved[0]["model"][sharded[pos]].shape
                pieces = _split(sharded[pos], [s["optimizer"]["state"][pos][name] for s in saved], meta,
                                world, multiple) if shaped else [value] * world
                for r in range(world):
                    out[r]["optimizer"]["state"].setdefault(pos, {})[name] = pieces[r]
    return out


def _sizes(key: str, meta: dict):
    parts = key.split(".")
    at = next((j for j, s in enumerate(parts) if s.startswith("_fsdp_shard")), None)
    if at is None:
        return None
    return meta["shard_info"][".".join(parts[:at])][".".join(parts[at:])]["_orig_size"]


def _split(key, shards, meta, world, multiple) -> list[torch.Tensor]:
    size = _sizes(key, meta)
    full = torch.cat(shards)
    if full.dim() == 1:  # flattened: cut to numel, pad to world * multiple elements
        full = full[:math.prod(size)]
        full = F.pad(full, [0, -full.numel() % (world * multiple)])
    else:  # shard_param_on_dim_0: rows
        full = full[:size[0]]
        full = F.pad(full, [0, 0] * (full.dim() - 1) + [0, -full.shape[0] % world])
    return [c.clone() for c in full.chunk(world)]
