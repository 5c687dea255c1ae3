"""Checkpoints in and out of the portable format, in one process, without a launcher.

Import (`polyshard ckpt import KIND SRC OUT`): a torch DCP directory (torch's get_state_dict layout, as
torchtitan, FSDP2 loops and Accelerate write it: `read_dcp`), or any kind a backend reads (its
descriptor's checkpoint_readers: DeepSpeed ZeRO, XLA FSDP shard files; the registry hands the reader
over). Optimizer moments and step counts come along.
Export to Hugging Face: parallel/checkpoint/hf.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from parallel.checkpoint.directory import library_versions, write_checkpoint
from parallel.checkpoint.portable import clean_name, save_state
from parallel.checkpoint.optim_state import hyperparams
from parallel.checkpoint.streamed import Streamed, in_parts, write_streamed


class CheckpointImportError(RuntimeError):
    """A source directory that is not the kind of checkpoint named."""


def import_checkpoint(read, kind: str, src: str | Path, out: str | Path, step: int | None = None,
                      trust: bool = False, packages: tuple[str, ...] = ()) -> Path:
    """`read`: the reader of `kind` (src dir -> (portable state, steps, world size));
    `trust`: unpickle the source's files fully (they may run code); by default they are read as data
    (parallel/checkpoint/safe.py); `packages`: distributions whose versions the manifest records."""
    state, found_step, world = read(Path(src), trust=trust)
    step = found_step if step is None else step
    if step is None:
        raise CheckpointImportError(f"{src}: a {kind} checkpoint records no step count; pass --step N (the "
                           "number of optimizer steps it was trained for)")

    def write(sink) -> None:
        if isinstance(state, Streamed):  # one source rank's part in memory at a time
            write_streamed(state, sink)
        else:
            save_state(state, sink, collective=False)
        sink.save_file("trainer.pt", {"step": step, "scheduler": None, "loaders": []})

    meta = {"backend": f"import:{kind}", "world_size": world, "step": step, "spec": None,
            "source": str(Path(src).resolve()), "versions": library_versions(packages)}
    return write_checkpoint(out, 0, write, meta, writers=1)


def named_groups(groups: list[dict], names_per_group: list[list[str]]) -> list[dict]:
    return [{**hyperparams(g), "params": names} for g, names in zip(groups, names_per_group)]


def read_dcp(src: Path, trust: bool = False, stream: bool = True,  # noqa: ARG001 - data only
             budget: int | None = None):
    """torch DCP written from get_state_dict: {"model": ..., "optim"/"optimizer": ...} or bare
    model keys, without a template. Streamed (`stream`): parts of at most `budget` bytes (default:
    the largest source file's; dcp_parts), each read from the source by its own DCP load when it is
    written, one in memory at a time; else loaded whole."""
    from parallel.checkpoint.portable import SafeReader

    if not (src / ".metadata").is_file():
        raise CheckpointImportError(f"{src}: no .metadata file; not a torch.distributed.checkpoint directory")
    # one reader for every load: DCP's index (O(keys x writers)) is parsed once, and checked here,
    # before DCP, which swallows a failing read
    reader = SafeReader(str(src))
    metadata = reader.read_metadata()
    if not stream:
        return _portable(_load_keys(reader, None), src), None, 1
    if budget is None:
        budget = max((f.stat().st_size for f in src.glob("*.distcp")), default=0)
    parts = [set(keys) for keys in dcp_parts(metadata, budget)]  # looked up per index entry
    return Streamed(lambda i: _portable(_load_keys(reader, parts[i]), src), len(parts)), None, 1


def dcp_parts(metadata, budget: int) -> list[list[str]]:
    """A DCP index's entries cut into parts in index order: tensors of at most `budget` bytes
    together (one larger tensor: a part of its own, read whole), everything not a tensor (param
    groups, extra state) in the first part."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = metadata.state_dict_metadata
    tensors = [k for k, v in entries.items() if isinstance(v, TensorStorageMetadata)]
    parts = in_parts(tensors, lambda k: entries[k].size.numel() * entries[k].properties.dtype.itemsize,
                     budget)
    parts[0][:0] = [k for k, v in entries.items() if not isinstance(v, TensorStorageMetadata)]
    return parts


def _load_keys(reader, keys: set[str] | None) -> dict:
    """The source's entries `keys` (None: all), as the nested dict they were saved from."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from parallel.checkpoint.portable import raise_refusal

    sd: dict = {}
    try:
        _load_state_dict(sd, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys),
                         no_dist=True)
    except CheckpointException as err:
        raise_refusal(err)
        raise
    return sd


def _portable(sd: dict, src: Path) -> dict:
    """A (part of a) get_state_dict layout as the portable state: clean names, param groups by
    name (where this part has them)."""
    model = sd.get("model", {k: v for k, v in sd.items() if torch.is_tensor(v)})
    state = {"model": {clean_name(k): v for k, v in model.items()}}
    optim = sd.get("optim", sd.get("optimizer"))
    if optim is not None:
        if not all(isinstance(k, str) for k in optim.get("state", {})):
            raise CheckpointImportError(f"{src}: optimizer state is keyed by position, not parameter name; "
                               "save it with torch.distributed.checkpoint.state_dict.get_state_dict")
        state["optim"] = {"state": {clean_name(k): v for k, v in optim.get("state", {}).items()}}
        if "param_groups" in optim:
            state["optim"]["param_groups"] = [{**g, "params": [clean_name(n) for n in g["params"]]}
                                              for g in optim["param_groups"]]
    return state
