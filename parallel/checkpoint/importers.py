"""Checkpoints in and out of the portable format, in one process, without a launcher.

Import (`polyshard ckpt import KIND SRC OUT`): a torch DCP directory (torch's get_state_dict layout, as
torchtitan, FSDP2 loops and Accelerate write it: `read_dcp`), or any kind a backend reads (its
descriptor's checkpoint_readers: DeepSpeed ZeRO, XLA FSDP shard files; the registry hands the reader
over). Optimizer moments and step counts come along.
Export to Hugging Face: parallel/checkpoint/hf/export.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from parallel.checkpoint.format.directory import library_versions
from parallel.checkpoint.background.finishing import write_checkpoint
from parallel.checkpoint.state.portable import clean_name, save_state
from parallel.checkpoint.state.optim_state import hyperparams
from parallel.checkpoint.state.streamed import Streamed, in_parts, write_streamed


class CheckpointImportError(RuntimeError):
    """A source directory that is not the kind of checkpoint named."""


def import_checkpoint(read, kind: str, src: str | Path, out: str | Path, step: int | None = None,
                      trust: bool = False, packages: tuple[str, ...] = ()) -> Path:
    """`read`: the reader of `kind` (src dir -> (portable state, steps, world size));
    `trust`: unpickle the source's files fully (they may run code); by default they are read as data
    (parallel/checkpoint/format/safe.py); `packages`: distributions whose versions the manifest records."""
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


# Accelerate's save_state (and HF Trainer's checkpoint-N, which calls it) with FSDP's sharded state
# dict: the model's DCP and the optimizer's DCP in folders of their own (accelerate.utils.fsdp_utils:
# FSDP_MODEL_NAME, OPTIMIZER_NAME), Trainer's step in trainer_state.json
PEER_MODEL, PEER_OPTIM, PEER_STEP = "pytorch_model_fsdp_0", "optimizer_0", "trainer_state.json"


def read_dcp(src: Path, trust: bool = False, stream: bool = True,  # noqa: ARG001 - data only
             budget: int | None = None):
    """torch DCP written from get_state_dict: {"model": ..., "optim"/"optimizer": ...} or bare
    model keys, without a template; or an Accelerate / HF Trainer FSDP checkpoint directory
    (`pytorch_model_fsdp_0/` and `optimizer_0/`), whole: weights and optimizer state by parameter
    name. Streamed (`stream`): parts of at most `budget` bytes (default: the largest source file's;
    dcp_parts), each read from the source by its own DCP load when it is written, one in memory at
    a time; else loaded whole."""
    from parallel.checkpoint.state.portable import SafeReader

    folders = [src]
    if not (src / ".metadata").is_file() and (src / PEER_MODEL / ".metadata").is_file():
        folders = [src / PEER_MODEL] + ([src / PEER_OPTIM] if (src / PEER_OPTIM / ".metadata")
                                        .is_file() else [])
    if not (folders[0] / ".metadata").is_file():
        raise CheckpointImportError(f"{src}: no .metadata file; not a torch.distributed.checkpoint "
                                    f"directory (nor Accelerate's, with {PEER_MODEL}/ in it)")
    # one reader per folder for every load: DCP's index (O(keys x writers)) is parsed once, and
    # checked here, before DCP, which swallows a failing read
    readers = [SafeReader(str(f)) for f in folders]
    metadata = [r.read_metadata() for r in readers]
    if not any(_model_keys(m) for m in metadata):
        raise CheckpointImportError(
            f"{src}: holds no model weights ({len(metadata[0].state_dict_metadata)} entries, none a "
            "model tensor): an optimizer state alone, as Accelerate's optimizer_N folder; import the "
            f"checkpoint directory above it, which holds {PEER_MODEL}/ too")
    step = peer_step(src)
    if not stream:
        sd: dict = {}
        for r in readers:
            sd.update(_load_keys(r, None))
        return _portable(sd, src), step, 1
    if budget is None:
        budget = max((f.stat().st_size for d in folders for f in d.glob("*.distcp")), default=0)
    parts = [(r, set(keys)) for r, m in zip(readers, metadata) for keys in dcp_parts(m, budget)]
    return Streamed(lambda i: _portable(_load_keys(*parts[i]), src), len(parts)), step, 1


def _model_keys(metadata) -> list[str]:
    return [k for k in metadata.state_dict_metadata if not k.startswith(("optim.", "optimizer."))]


def peer_step(src: Path) -> int | None:
    """HF Trainer's global_step (trainer_state.json beside the state), else None (--step)."""
    from parallel.files import load_json

    if not (src / PEER_STEP).is_file():
        return None
    step = load_json(src / PEER_STEP, "HF Trainer's state", follow=False).get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointImportError(f"{src / PEER_STEP}: global_step {step!r} is not a step count")
    return step


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

    from parallel.checkpoint.state.portable import raise_refusal

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
