"""A polyshard checkpoint as a DeepSpeed universal checkpoint (`polyshard ckpt export --to
deepspeed-universal`): the layout `ds_to_universal` writes and `DeepSpeedEngine.load_checkpoint` reads
with `"checkpoint": {"load_universal": true}`, at any ZeRO-1/2 world size.

    OUT/latest_universal                       the tag below
    OUT/global_step<N>/zero/<name>/fp32.pt     {"param": fp32 weight}, per trained parameter
    OUT/global_step<N>/zero/<name>/<key>.pt    {"param": tensor} per optimizer entry (exp_avg, ...)
    OUT/global_step<N>/zero/<name>/step.pt     the optimizer's step count
    OUT/global_step<N>/zero/optimizer_state.pt param groups' hyper-parameters, clip_grad, ds_version
    OUT/global_step<N>/mp_rank_00_model_states.pt  shapes per group, untrained tensors, counters

One tensor is in memory at a time (read by key from the DCP state), so exporting a 70B run needs no
more host memory than its largest parameter. Untrained tensors (frozen parameters, buffers) go into
the model-states file's `module`, listed as buffer_names: DeepSpeed's universal load does not read
them (it restores trained parameters only), polyshard's import does.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from parallel.checkpoint.directory import resolve, verify_checkpoint
from parallel.checkpoint.importers import CheckpointImportError
from parallel.checkpoint.portable import read_groups, read_tensor, tensor_shapes


def _one(path: Path, key: str, shape_dtype) -> torch.Tensor:
    return read_tensor(path, key, *shape_dtype)


def write_universal(src: str | Path, out: str | Path) -> Path:
    """Export `src` (a checkpoint, or a directory with `latest`) into `out`; returns the tag dir."""
    path, out = resolve(src), Path(out)
    manifest = verify_checkpoint(path)
    shapes, groups = tensor_shapes(path), read_groups(path)
    trained = [name for group in groups for name in group["params"]]
    missing = [n for n in trained if f"model.{n}" not in shapes]
    if missing:
        raise CheckpointImportError(f"{path}: optimizer groups name {missing[:3]}, which the model "
                                    "state does not hold")
    tag = f"global_step{manifest['step']}"
    tag_dir = out / tag
    zero = tag_dir / "zero"
    for name in trained:
        folder = zero / name
        folder.mkdir(parents=True, exist_ok=True)
        weight = _one(path, f"model.{name}", shapes[f"model.{name}"]).float()
        torch.save({"param": weight}, folder / "fp32.pt")
        prefix = f"optim.state.{name}."
        for key in (k[len(prefix):] for k in shapes if k.startswith(prefix)):
            if "." in key:  # another parameter's entry whose name extends this one
                continue
            value = _one(path, prefix + key, shapes[prefix + key])
            torch.save(value if key == "step" else {"param": value}, folder / f"{key}.pt")
    _write_states(path, manifest, tag_dir, groups, shapes, set(trained))
    (out / "latest_universal").write_text(tag)
    return tag_dir


def _write_states(path: Path, manifest: dict, tag_dir: Path, groups: list[dict], shapes: dict,
                  trained: set[str]) -> None:
    """zero/optimizer_state.pt and mp_rank_00_model_states.pt: what DeepSpeed reads besides the
    per-parameter files (its _load_global_state asserts ds_version; load_checkpoint needs the
    counters)."""
    version = manifest.get("versions", {}).get("deepspeed")
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    clip = (manifest.get("spec") or {}).get("grad_clip") or 0.0
    index = iter(range(len(trained)))
    torch.save({"param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                  "params": [next(index) for _ in g["params"]]} for g in groups],
                "clip_grad": clip, "ds_version": version}, tag_dir / "zero" / "optimizer_state.pt")
    untrained = sorted(k[len("model."):] for k in shapes if k.startswith("model.")
                       and k[len("model."):] not in trained)
    step = manifest["step"]
    torch.save({
        "module": {n: _one(path, f"model.{n}", shapes[f"model.{n}"]) for n in untrained},
        "buffer_names": untrained, "frozen_param_shapes": OrderedDict(), "shared_params": {},
        "param_shapes": [OrderedDict((n, torch.Size(shapes[f"model.{n}"][0])) for n in g["params"])
                         for g in groups],
        "dp_world_size": manifest["world_size"], "mp_world_size": 1, "global_steps": step,
        "skipped_steps": 0, "iteration": step, "ds_version": version, "lr_scheduler": None,
    }, tag_dir / "mp_rank_00_model_states.pt")
