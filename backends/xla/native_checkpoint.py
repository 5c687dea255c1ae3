"""XLA FSDP v1 sharded checkpoints in (`polyshard ckpt import xla`): `*rank-R-of-N*` files holding
`model`, `shard_metadata` and optionally `optimizer`.

Streamed by default (#44), one rank's file in memory at a time (checkpoint/streamed.py). XLA FSDP
flattens each sharded tensor (one parameter, or with `flatten_parameters` a flat parameter that is
several concatenated), pads it to a multiple of the world size and gives rank r elements
[r * L, (r + 1) * L) of it, L its shard's length; with `shard_param_on_dim_0` the shard is rows
[r * R, (r + 1) * R), which flattened row-major is the same range. torch_xla's own
`consolidate_sharded_state_dicts` (the whole path, `stream=False`) concatenates every rank's shards;
here each rank's shard becomes FlatRange blocks of the parameters it overlaps, its Adam moments (each
shaped like its shard) the same blocks of theirs, and every rank file is one writer of the state.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path

import torch

from parallel.checkpoint.state.chunks import FlatRange
from parallel.checkpoint.importers import CheckpointImportError, named_groups
from parallel.checkpoint.state.portable import clean_name
from parallel.files import regular_file
from parallel.checkpoint.state.optim_state import shared_step
from parallel.checkpoint.format.safe import torch_load
from parallel.checkpoint.state.streamed import Streamed

RANK_FILE = re.compile(r"rank[-_]?(\d+)(?:-of-(\d+))?")
WHAT = "an XLA FSDP shard file"


def read_xla(src: Path, trust: bool = False, stream: bool = True):
    """The portable state of XLA FSDP v1 shard files: streamed (one rank's file mapped at a time),
    or with `stream=False` consolidated whole by torch_xla's consolidate_sharded_state_dicts."""
    files = rank_files(src)
    if not stream:
        return _read_whole(files, trust)
    first = torch_load(files[0], WHAT, trust=trust, mmap=True)  # data only; tensors mapped
    meta = _metadata(first, files)
    layout = _layout(first["model"], meta, files[0])
    optim = first.get("optimizer", first.get("optim"))
    groups = _groups(optim, layout, files[0]) if optim is not None else None
    shapes = {key: tuple(first["model"][key].shape) for key, _ in layout}
    buffers = {k for k in first["model"] if k not in shapes}
    for key, params in layout:  # the ranks' pieces together must cover every element
        if meta["world_size"] * math.prod(shapes[key]) < max(o + n for _, _, o, n in params):
            raise CheckpointImportError(f"{files[0]}: {key} has {math.prod(shapes[key])} elements per "
                                        f"rank, too few for its parameters at {meta['world_size']} ranks")
    del first, optim

    def part(i: int) -> dict:
        saved = torch_load(files[i], WHAT, trust=trust, mmap=True)
        if saved.get("shard_metadata", {}).get("rank", i) != i:
            raise CheckpointImportError(f"{files[i]}: holds rank {saved['shard_metadata']['rank']}'s shards, "
                                        f"not rank {i}'s; the rank files do not belong together")
        sd, optim = saved["model"], saved.get("optimizer", saved.get("optim"))
        model, moments = {}, {}
        for pos, (key, params) in enumerate(layout):
            shard = sd.get(key) if isinstance(sd, dict) else None
            if not torch.is_tensor(shard) or tuple(shard.shape) != shapes[key]:
                raise CheckpointImportError(f"{files[i]}: {key} is not a tensor of shape {shapes[key]} "
                                            "as in rank 0's file; the rank files do not belong together")
            entry = optim["state"].get(pos, {}) if optim is not None else {}
            flats = {k: v.reshape(-1) for k, v in entry.items()  # moments: shaped like the shard
                     if torch.is_tensor(v) and v.shape == shard.shape}
            flat = shard.reshape(-1)
            for name, shape, lo, start, n in _places(params, flat.numel(), i):
                model[name] = FlatRange(flat[lo:lo + n], start, shape)
                if flats:
                    moments[name] = {k: FlatRange(v[lo:lo + n], start, shape) for k, v in flats.items()}
        if i:
            return {"model": model, "optim": {"state": moments}} if optim is not None else {"model": model}
        info = meta.get("buffer_info", {})
        for key in (k for k in sd if k in buffers):
            value = sd[key]
            model[_full_name(key)] = value.to(info[key]["_orig_dtype"]) if key in info else value
        if optim is None:
            return {"model": model}
        step = shared_step(optim["state"].values())
        states = {n: {"step": step} if step is not None else {}
                  for pos, (_, params) in enumerate(layout) if pos in optim["state"]
                  for n, *_ in params}
        for name, entry in moments.items():
            states[name].update(entry)
        return {"model": model, "optim": {"state": states, "param_groups": groups}}

    return Streamed(part, meta["world_size"]), None, meta["world_size"]


def rank_files(src: Path) -> list[Path]:
    """src's `*rank-R-of-N*` files in rank order: ranks 0..N-1, each once."""
    found = {}
    for f in src.iterdir() if src.is_dir() else ():
        m = RANK_FILE.search(f.name)
        if m and (f.is_symlink() or f.is_file()):  # a link is refused here, before any read
            regular_file(f, WHAT, 1 << 62, follow=False)
            found.setdefault(int(m.group(1)), []).append(f)
    if not found:
        raise CheckpointImportError(f"{src}: no files named like *rank-R-of-N* (XLA FSDP shard files)")
    twice = [str(f) for fs in found.values() if len(fs) > 1 for f in fs]
    if twice or sorted(found) != list(range(len(found))):
        raise CheckpointImportError(
            f"{src}: the rank files are not ranks 0..{len(found) - 1}, each once "
            f"(ranks {sorted(found)}{', twice: ' + ', '.join(twice) if twice else ''}); keep one "
            "save's files in the directory")
    return [found[r][0] for r in range(len(found))]


def _metadata(first: dict, files: list[Path]) -> dict:
    meta = first.get("shard_metadata") if isinstance(first, dict) else None
    if not isinstance(meta, dict) or "shard_info" not in meta or "model" not in first:
        raise CheckpointImportError(f"{files[0]}: not {WHAT}: it needs `model` and `shard_metadata` "
                                    "(XlaFullyShardedDataParallel.get_shard_metadata())")
    if meta.get("world_size") != len(files):
        raise CheckpointImportError(f"{files[0]}: saved at world size {meta.get('world_size')}, but the "
                                    f"directory holds {len(files)} rank files; all of one save's are needed")
    return meta


def _layout(sd: dict, meta: dict, path: Path) -> list[tuple[str, list]]:
    """Each sharded key of a rank's `model`, in order, with the parameters its flattened (padded)
    tensor concatenates: (name, shape, offset in it, numel); names as consolidation gives them."""
    layout = []
    for key in sd:
        parts = key.split(".")
        at = next((j for j, s in enumerate(parts) if s.startswith("_fsdp_shard")), None)
        if at is None:
            continue  # a buffer, kept whole (rank 0's)
        prefix, suffix = ".".join(parts[:at]), ".".join(parts[at:])
        try:
            layout.append((key, _params(meta, prefix, suffix)))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise CheckpointImportError(f"{path}: shard_metadata does not describe {key} (its shard_info, "
                                        "or its flat parameter's flatten_info)") from None
    return layout


def _params(meta: dict, prefix: str, suffix: str) -> list:
    """(name, shape, offset, numel) of the parameters in one sharded key (ValueError: inconsistent)."""
    info = meta["shard_info"][prefix][suffix]
    full = f"{prefix}.{info['_orig_name']}" if prefix else str(info["_orig_name"])
    if "_fsdp_wrapped_module.flat_param_" not in full:
        size = tuple(int(d) for d in info["_orig_size"])
        return [(_full_name(full), size, 0, math.prod(size))]
    names, shapes, numels = meta["flatten_info"][full]  # flatten_parameters: several, concatenated
    inner, offset, params = ".".join(full.split(".")[:-1]), 0, []
    for name, shape, numel in zip(names, shapes, numels, strict=True):
        shape = tuple(int(d) for d in shape)
        if int(numel) != math.prod(shape) or min(shape, default=0) < 0:
            raise ValueError(name)
        params.append((_full_name(f"{inner}.{name}" if inner else str(name)), shape, offset, int(numel)))
        offset += int(numel)
    return params


def _places(params: list, length: int, rank: int):
    """(name, shape, lo, start, n): rank's shard elements [lo, lo + n) are elements [start,
    start + n) of parameter `name`."""
    first = rank * length
    for name, shape, offset, numel in params:
        lo, hi = max(offset, first), min(offset + numel, first + length)
        if hi > lo:
            yield name, shape, lo - first, lo - offset, hi - lo


def _groups(optim: dict, layout: list, path: Path) -> list[dict]:
    """param_groups by name: the optimizer indexes parameters() in order, the sharded keys' order."""
    indices = [i for g in optim["param_groups"] for i in g["params"]]
    if sorted(indices) != list(range(len(layout))):
        raise CheckpointImportError(
            f"{path}: the optimizer holds {len(indices)} parameters and the model {len(layout)} "
            "sharded ones; an XLA FSDP optimizer state maps to names only when it covers every "
            "parameter in parameters() order")
    return named_groups(optim["param_groups"],
                        [[n for i in g["params"] for n, *_ in layout[i][1]] for g in optim["param_groups"]])


def _full_name(name: str) -> str:
    return clean_name(name.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", ""))


def _read_whole(files: list[Path], trust: bool):
    """torch_xla's consolidate_sharded_state_dicts of every rank's file at once, applied to the
    weights and to each optimizer entry (which is sharded exactly like its parameter)."""
    try:
        from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts
    except ImportError:
        raise CheckpointImportError("stream=False consolidates with torch_xla's own "
                                    "consolidate_sharded_state_dicts, which needs torch_xla: run it "
                                    "in the XLA lane (docs/lanes.md), or stream (the default), "
                                    "which needs no torch_xla") from None

    shards = [torch_load(f, WHAT, trust=trust) for f in files]  # data only
    meta = _metadata(shards[0], files)
    with contextlib.redirect_stdout(io.StringIO()):
        model = consolidate_sharded_state_dicts([s["model"] for s in shards], meta)
    state = {"model": {clean_name(k): v for k, v in model.items()}}
    optims = [s.get("optimizer", s.get("optim")) for s in shards]
    if optims[0] is not None:
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
