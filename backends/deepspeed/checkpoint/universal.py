"""A polyshard checkpoint as a DeepSpeed universal checkpoint (`polyshard ckpt export --to
deepspeed-universal`): the layout `ds_to_universal` writes and `DeepSpeedEngine.load_checkpoint` reads
with `"checkpoint": {"load_universal": true}`, at any ZeRO-1/2 world size.

    OUT/latest_universal                       the tag below
    OUT/global_step<N>/zero/<name>/fp32.pt     {"param": fp32 weight}, per trained parameter
    OUT/global_step<N>/zero/<name>/<key>.pt    {"param": tensor} per optimizer entry (exp_avg, ...)
    OUT/global_step<N>/zero/<name>/step.pt     the optimizer's step count
    OUT/global_step<N>/zero/optimizer_state.pt param groups' hyper-parameters, clip_grad, ds_version
    OUT/global_step<N>/mp_rank_00_model_states.pt  shapes per group, untrained tensors, counters

One trained parameter is in memory at a time (its weight and optimizer entries, read in one call
by key from the DCP state, whose index is parsed once), so exporting a 70B run needs about as much
host memory as its largest parameter's state. Untrained tensors (frozen parameters, buffers) go
together into the model-states file's `module`, as DeepSpeed keeps them, listed as buffer_names:
DeepSpeed's universal load does not read them (it restores trained parameters only), polyshard's
import does. A run with a large frozen part holds that part while writing this one file.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from pathlib import Path

import torch

from backends.deepspeed.runtime.library import import_deepspeed
from parallel.checkpoint.format.directory import resolve
from parallel.checkpoint.format.manifest import verify_checkpoint
from parallel.checkpoint.importers import CheckpointImportError
from parallel.checkpoint.format.safe import child_name
from parallel.checkpoint.state.portable import open_state, read_tensors, tensor_shapes
from parallel.files import write_atomic
from parallel.checkpoint.state.optim_state import read_groups

OPTIM_STATE = "optim.state."


def write_universal(src: str | Path, out: str | Path) -> Path:
    """Export `src` (a checkpoint, or a directory with `latest`) into `out`; returns the tag dir."""
    path, out = resolve(src), Path(out)
    manifest = verify_checkpoint(path)
    reader = open_state(path)
    shapes, groups = tensor_shapes(path, reader=reader), read_groups(path, reader)
    trained = [name for group in groups for name in group["params"]]
    missing = [n for n in trained if f"model.{n}" not in shapes]
    if missing:
        raise CheckpointImportError(f"{path}: optimizer groups name {missing[:3]}, which the model "
                                    "state does not hold")
    entries: dict[str, list[str]] = defaultdict(list)  # parameter -> its optimizer entries
    for key in shapes:
        if key.startswith(OPTIM_STATE):
            name, _, entry = key[len(OPTIM_STATE):].rpartition(".")
            entries[name].append(entry)
    tag_dir = out / f"global_step{manifest['step']}"
    for name in trained:
        keys = [f"model.{name}", *(f"{OPTIM_STATE}{name}.{e}" for e in entries[name])]
        got = read_tensors(path, {k: shapes[k] for k in keys}, reader)
        # names come from the checkpoint: each must be one plain path component inside zero/
        folder = tag_dir / "zero" / child_name(name, "a parameter name", path)
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"param": got.pop(f"model.{name}").float()}, folder / "fp32.pt")
        for key, value in got.items():
            entry = child_name(key.rpartition(".")[2], "an optimizer entry", path)
            torch.save(value if entry == "step" else {"param": value}, folder / f"{entry}.pt")
    _write_states(path, manifest, tag_dir, groups, shapes, set(trained), reader)
    write_atomic(out / "latest_universal", tag_dir.name.encode())  # never through a planted link
    return tag_dir


def _write_states(path: Path, manifest: dict, tag_dir: Path, groups: list[dict], shapes: dict,
                  trained: set[str], reader) -> None:
    """zero/optimizer_state.pt and mp_rank_00_model_states.pt: what DeepSpeed reads besides the
    per-parameter files (its _load_global_state asserts ds_version; load_checkpoint needs the
    counters)."""
    version = manifest.get("versions", {}).get("deepspeed")
    if version is None:
        version = import_deepspeed().__version__
    clip = (manifest.get("spec") or {}).get("grad_clip") or 0.0
    index = iter(range(len(trained)))
    torch.save({"param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                  "params": [next(index) for _ in g["params"]]} for g in groups],
                "clip_grad": clip, "ds_version": version}, tag_dir / "zero" / "optimizer_state.pt")
    untrained = sorted(k[len("model."):] for k in shapes if k.startswith("model.")
                       and k[len("model."):] not in trained)
    step = manifest["step"]
    torch.save({
        "module": {n[len("model."):]: t for n, t in read_tensors(
            path, {f"model.{n}": shapes[f"model.{n}"] for n in untrained}, reader).items()},
        "buffer_names": untrained, "frozen_param_shapes": OrderedDict(), "shared_params": {},
        "param_shapes": [OrderedDict((n, torch.Size(shapes[f"model.{n}"][0])) for n in g["params"])
                         for g in groups],
        "dp_world_size": manifest["world_size"], "mp_world_size": 1, "global_steps": step,
        "skipped_steps": 0, "iteration": step, "ds_version": version, "lr_scheduler": None,
    }, tag_dir / "mp_rank_00_model_states.pt")
