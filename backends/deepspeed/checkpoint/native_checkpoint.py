"""DeepSpeed ZeRO checkpoints in (`polyshard ckpt import deepspeed`): plain DeepSpeed, Accelerate and
Lightning write them. Every file is read as data (parallel/checkpoint/format/safe.py): torch's weights_only
unpickler plus the DeepSpeed classes these files hold (found with torch's
get_unsafe_globals_in_checkpoint on ZeRO-2 and universal checkpoints DeepSpeed 0.19.8 wrote)."""

from __future__ import annotations

import contextlib
import gc
import io
from pathlib import Path

import torch

from parallel.checkpoint.importers import CheckpointImportError, named_groups
from parallel.checkpoint.state.portable import clean_name
from parallel.checkpoint.state.optim_state import shared_step
from parallel.checkpoint.format.safe import child_name, own_folder, read_text, torch_load
from backends.deepspeed.runtime.library import import_deepspeed


def deepspeed_classes() -> tuple:
    """The non-tensor classes DeepSpeed's checkpoint files hold: the loss scaler (fp16 or not), the
    ZeRO stage enum, and ZeRO-1/2's fragment addresses."""
    import_deepspeed()  # the first import, without mlflow (library.py)
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)


def _load(path: Path, what: str, trust: bool, mmap: bool = False):
    return torch_load(path, what, deepspeed_classes(), trust, mmap=mmap)


def _tag_dir(src: Path, pointer: str) -> Path:
    """The checkpoint a `latest` file names (a plain name inside src), else src itself."""
    if not (src / pointer).is_file():
        return src
    text = read_text(src / pointer, f"DeepSpeed's {pointer} pointer", 4096, follow=False)
    return own_folder(src / child_name(text.strip(), f"its {pointer} file", src),
                      f"the checkpoint {pointer} names")


def read_deepspeed(src: Path, trust: bool = False, stream: bool = True):
    """A ZeRO-1/2/3 checkpoint, streamed (stream_import.py: one rank's optimizer file, and its
    model-states file's frozen parameters, in memory at a time), or with `stream=False` DeepSpeed's
    own zero_to_fp32 merge, applied to the fp32 partitions (and the frozen parameters) and then to
    each optimizer entry partitioned the same way (exp_avg, momentum_buffer...), the whole state in
    memory."""
    import_deepspeed()
    from deepspeed.utils import zero_to_fp32 as z

    from backends.deepspeed.checkpoint.stream_import import checked_partitions, streamed_zero

    tag_dir = _tag_dir(src, "latest")
    with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints progress
        model_files = z.get_model_state_files(str(tag_dir))
        # zero_to_fp32 unpickles them fully: each is checked as data first (mapped: no tensor's
        # bytes read), then parsed one at a time; a streamed import drops ZeRO-3's slices of the
        # frozen parameters and reads them again part by part (`frozen`, mapped)
        models, steps = [], None
        for i, f in enumerate(model_files):
            checked = _load(Path(f), "a DeepSpeed model-states file", trust, mmap=True)
            steps = checked.get("global_steps") if i == 0 else steps
            del checked
            (parsed,) = z.parse_model_states([f])
            if stream:
                parsed.frozen_param_fragments = None
            models.append(parsed)
            gc.collect()

        def frozen(i: int) -> dict:  # rank i's frozen slices (ZeRO-1/2: rank 0's, whole)
            return _load(Path(model_files[i]), "a DeepSpeed model-states file", trust,
                         mmap=True).get("frozen_param_fragments") or {}

        optim_files = z.get_optim_files(str(tag_dir))

        def optim(f) -> dict:  # mapped: a streamed import's planning pass reads no tensor's bytes
            return _load(Path(f), "a DeepSpeed optimizer-states file", trust,
                         mmap=True)["optimizer_state_dict"]

        first = optim(optim_files[0])
        stage, world = first["zero_stage"], first["partition_count"]
        world = max(world) if isinstance(world, list) else world
        del first
        gc.collect()  # a loaded optimizer file holds reference cycles: freed now
        if world != len(optim_files):
            raise CheckpointImportError(f"{tag_dir}: {len(optim_files)} optimizer files for {world} "
                                        "partitions; a rank's file is missing")
        if stream:
            return streamed_zero(models, optim_files, stage, world, optim, frozen), steps, world
        shapes = [dict(g) for g in models[0].param_shapes]
        saved = [optim(f) for f in optim_files]
        for f, one in zip(optim_files, saved):
            checked_partitions(one, shapes, stage, world, f)
        return _merged(models, saved, stage, world), steps, world


def _merged(models, saved: list, stage: int, world: int) -> dict:
    """The whole state by zero_to_fp32's merge, from every rank's optimizer state dict (fp32
    partitions and the base optimizer's: "base_optimizer_state" at ZeRO-1/2,
    "optimizer_state_dict" at ZeRO-3)."""
    from deepspeed.utils import zero_to_fp32 as z

    with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints progress
        key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
        fp32_groups = [s[key] for s in saved]
        paddings = saved[0].get("param_alignment_paddings")
        raw = [s.get("base_optimizer_state", s.get("optimizer_state_dict")) for s in saved]

        def merge(flat_groups, exclude_frozen: bool):
            if stage <= 2:
                out = z._get_fp32_state_dict_from_zero2_checkpoint(world, flat_groups, models,
                                                                   exclude_frozen, paddings)
            else:
                out = z._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, models,
                                                                   exclude_frozen)
            return z.to_torch_tensor(out)

        # the model with its frozen parameters (which zero_to_fp32's last argument would leave
        # out); the moments without (a frozen parameter has none)
        model = merge(fp32_groups, exclude_frozen=False)
        keys = [k for k, v in raw[0]["state"][0].items() if torch.is_tensor(v) and v.dim() == 1
                and v.numel() > 1]
        moments = {k: merge([[r["state"][g][k] for g in sorted(r["state"])] for r in raw], True)
                   for k in keys}
    raw_names = [list(shapes) for shapes in models[0].param_shapes]  # per (sub-)group, in order
    step = shared_step(raw[0]["state"].values())
    state = {clean_name(n): {k: moments[k][n] for k in keys} for group in raw_names for n in group}
    if step is not None:
        for entry in state.values():
            entry["step"] = step
    # ZeRO-1/2 keep one flat group per optimizer param group; ZeRO-3 splits them into sub-groups.
    per_group = ([[clean_name(n) for n in g] for g in raw_names] if stage <= 2
                 else [[clean_name(n) for g in raw_names for n in g]])
    return {"model": {clean_name(k): v for k, v in model.items()},
            "optim": {"state": state, "param_groups": named_groups(raw[0]["param_groups"], per_group)}}


def read_deepspeed_universal(src: Path, trust: bool = False):
    """A DeepSpeed universal checkpoint (what `ds_to_universal` writes and `load_universal_checkpoint`
    reads): `zero/<name>/fp32.pt`, one file per optimizer entry (`exp_avg.pt`, ...) and `step.pt` per
    parameter, the param groups in `zero/optimizer_state.pt`, and the model-states file for group
    membership, buffers, frozen and tied parameters. Streamed: one parameter's files in memory at a
    time (checkpoint/streamed.py), part 0 also the buffers, frozen parameters and param groups."""
    from parallel.checkpoint.state.streamed import Streamed

    tag_dir = _tag_dir(src, "latest_universal")
    zero, model_file = tag_dir / "zero", tag_dir / "mp_rank_00_model_states.pt"
    if zero.is_symlink():
        own_folder(zero, "zero/")
    if not zero.is_dir() or not model_file.is_file():
        raise CheckpointImportError(f"{tag_dir}: not a DeepSpeed universal checkpoint (needs zero/ "
                                    "and mp_rank_00_model_states.pt, as ds_to_universal writes)")
    states = _load(model_file, "a DeepSpeed model-states file", trust)
    groups = _load(zero / "optimizer_state.pt", "DeepSpeed's universal optimizer state", trust)
    names = [[clean_name(n) for n in shapes] for shapes in states["param_shapes"]]
    raws = [n for shapes in states["param_shapes"] for n in shapes]
    folders = {raw: zero / child_name(raw, "a parameter name", model_file) for raw in raws}
    for raw, folder in folders.items():
        if folder.is_symlink():
            own_folder(folder, f"parameter {raw}'s folder")
        if not (folder / "fp32.pt").is_file():
            raise CheckpointImportError(f"{folder / 'fp32.pt'}: missing (parameter {raw})")
    extra = _whole_entries(states, model_file)  # buffers and frozen parameters, by name
    aliases = {clean_name(a): clean_name(c) for a, c in (states.get("shared_params") or {}).items()}
    steps = {raw: torch.as_tensor(_load(folders[raw] / "step.pt", "a universal step file", trust),
                                  dtype=torch.float32).clone()
             for raw in raws if (folders[raw] / "step.pt").is_file()}
    shared_step([{"step": t} for t in steps.values()])  # one step count, or an error naming it
    param_groups = named_groups(groups["param_groups"], names)
    found = states.get("global_steps"), states.get("dp_world_size")
    del states, groups  # the model-states file holds the whole module: not kept
    gc.collect()

    def part(i: int) -> dict:
        model, optim = (dict(extra), {}) if i == 0 else ({}, {})
        for raw in raws[i:i + 1]:
            folder, name = folders[raw], clean_name(raw)
            # mapped: the planning pass reads no tensor's bytes (streamed.py builds a part twice)
            model[name] = _load(folder / "fp32.pt", "a universal fp32 file", trust, True)["param"]
            optim[name] = {f.stem: _load(f, "a universal optimizer file", trust, True)["param"]
                           for f in sorted(folder.glob("*.pt")) if f.stem not in ("fp32", "step")}
            if raw in steps:
                optim[name]["step"] = steps[raw]
        model.update({a: model[c] for a, c in aliases.items() if c in model})
        state = {"model": model, "optim": {"state": optim}}
        if i == 0:
            state["optim"]["param_groups"] = param_groups
        return state

    return Streamed(part, max(1, len(raws))), *found


def _whole_entries(states: dict, model_file: Path) -> dict:
    """Frozen parameters and buffers from the model-states file's module state (fp32 where floating)."""
    module = states.get("module") or {}
    out = {}
    for raw in list(states.get("frozen_param_shapes") or {}) + list(states.get("buffer_names") or []):
        if raw not in module:
            raise CheckpointImportError(f"{model_file}: {raw} is not in its module state")
        out[clean_name(raw)] = module[raw].float() if module[raw].is_floating_point() \
            else module[raw]
    return out
