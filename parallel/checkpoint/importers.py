"""Checkpoints in and out of the portable format, in one process, without a launcher.

Import (`polyshard ckpt import KIND SRC OUT`): a torch DCP directory (torch's get_state_dict layout, as
torchtitan, FSDP2 loops and Accelerate write it), a DeepSpeed ZeRO checkpoint (plain DeepSpeed,
Accelerate, Lightning), or an XLA FSDP sharded checkpoint (`*rank-R-of-N*` files holding `model`,
`shard_metadata` and optionally `optimizer`). Optimizer moments and step counts come along.
Export (`polyshard ckpt export --to hf`): safetensors + config.json for `from_pretrained`.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import torch

from parallel.checkpoint.directory import (
    library_versions,
    resolve,
    verify_checkpoint,
    write_checkpoint,
)
from parallel.checkpoint.portable import clean_name, hyperparams, read_model, save_state


class CheckpointImportError(RuntimeError):
    """A source directory that is not the kind of checkpoint named."""


def import_checkpoint(kind: str, src: str | Path, out: str | Path, step: int | None = None) -> Path:
    state, found_step, world = READERS[kind](Path(src))
    step = found_step if step is None else step
    if step is None:
        raise CheckpointImportError(f"{src}: a {kind} checkpoint records no step count; pass --step N (the "
                           "number of optimizer steps it was trained for)")

    def write(tmp: Path) -> None:
        save_state(state, tmp, collective=False)
        torch.save({"step": step, "scheduler": None, "loaders": []}, tmp / "trainer.pt")

    meta = {"backend": f"import:{kind}", "world_size": world, "step": step, "spec": None,
            "source": str(Path(src).resolve()), "versions": library_versions()}
    return write_checkpoint(out, 0, write, meta)


def _named_groups(groups: list[dict], names_per_group: list[list[str]]) -> list[dict]:
    return [{**hyperparams(g), "params": names} for g, names in zip(groups, names_per_group)]


def read_dcp(src: Path):
    """torch DCP written from get_state_dict: {"model": ..., "optim"/"optimizer": ...} or bare
    model keys. Loaded whole in this process, without a template."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if not (src / ".metadata").is_file():
        raise CheckpointImportError(f"{src}: no .metadata file; not a torch.distributed.checkpoint directory")
    sd: dict = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(str(src)),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    model = sd.get("model", {k: v for k, v in sd.items() if torch.is_tensor(v)})
    model = {clean_name(k): v for k, v in model.items()}
    optim = sd.get("optim", sd.get("optimizer"))
    state = {"model": model}
    if optim is not None:
        if not all(isinstance(k, str) for k in optim.get("state", {})):
            raise CheckpointImportError(f"{src}: optimizer state is keyed by position, not parameter name; "
                               "save it with torch.distributed.checkpoint.state_dict.get_state_dict")
        groups = [{**g, "params": [clean_name(n) for n in g["params"]]} for g in optim["param_groups"]]
        state["optim"] = {"state": {clean_name(k): v for k, v in optim["state"].items()},
                          "param_groups": groups}
    return state, None, 1


def read_deepspeed(src: Path):
    """A ZeRO-1/2/3 checkpoint: DeepSpeed's own zero_to_fp32 merge, applied to the fp32 partitions
    and then to each optimizer entry partitioned the same way (exp_avg, momentum_buffer...)."""
    from deepspeed.utils import zero_to_fp32 as z

    tag_dir = src / (src / "latest").read_text().strip() if (src / "latest").is_file() else src
    with contextlib.redirect_stdout(io.StringIO()):  # zero_to_fp32 prints progress
        model_files = z.get_model_state_files(str(tag_dir))
        models = z.parse_model_states(model_files)
        # each optimizer file loaded once: fp32 partitions and the base optimizer's state dict
        # ("base_optimizer_state" at ZeRO-1/2, "optimizer_state_dict" at ZeRO-3)
        saved = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
                 for f in z.get_optim_files(str(tag_dir))]
        stage = saved[0]["zero_stage"]
        world = max(saved[0]["partition_count"]) if isinstance(saved[0]["partition_count"], list) \
            else saved[0]["partition_count"]
        if world != len(saved):
            raise CheckpointImportError(f"{tag_dir}: {len(saved)} optimizer files for {world} "
                                        "partitions; a rank's file is missing")
        key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
        fp32_groups = [s[key] for s in saved]
        paddings = saved[0].get("param_alignment_paddings")
        raw = [s.get("base_optimizer_state", s.get("optimizer_state_dict")) for s in saved]

        def merge(flat_groups):
            if stage <= 2:
                out = z._get_fp32_state_dict_from_zero2_checkpoint(world, flat_groups, models, True,
                                                                   paddings)
            else:
                out = z._get_fp32_state_dict_from_zero3_checkpoint(world, flat_groups, models, True)
            return z.to_torch_tensor(out)

        model = merge(fp32_groups)
        keys = [k for k, v in raw[0]["state"][0].items() if torch.is_tensor(v) and v.dim() == 1
                and v.numel() > 1]
        moments = {k: merge([[r["state"][g][k] for g in sorted(r["state"])] for r in raw])
                   for k in keys}
    raw_names = [list(shapes) for shapes in models[0].param_shapes]  # per (sub-)group, in order
    step = _shared_step(raw[0]["state"].values())
    state = {clean_name(n): {k: moments[k][n] for k in keys} for group in raw_names for n in group}
    if step is not None:
        for entry in state.values():
            entry["step"] = step
    # ZeRO-1/2 keep one flat group per optimizer param group; ZeRO-3 splits them into sub-groups.
    per_group = ([[clean_name(n) for n in g] for g in raw_names] if stage <= 2
                 else [[clean_name(n) for g in raw_names for n in g]])
    steps = torch.load(model_files[0], map_location="cpu", weights_only=False).get("global_steps")
    return ({"model": {clean_name(k): v for k, v in model.items()},
             "optim": {"state": state, "param_groups": _named_groups(raw[0]["param_groups"],
                                                                     per_group)}}, steps, world)


def _shared_step(entries) -> torch.Tensor | None:
    steps = {float(e["step"]) for e in entries if "step" in e}
    if len(steps) > 1:
        raise CheckpointImportError(f"optimizer groups disagree on the step count: {sorted(steps)}")
    return torch.tensor(steps.pop()) if steps else None


RANK_FILE = re.compile(r"rank[-_]?(\d+)(?:-of-(\d+))?")


def read_xla(src: Path):
    """XLA FSDP v1 shards: consolidated by torch_xla's own consolidate_sharded_state_dicts, applied to
    the weights and to each optimizer entry (which is sharded exactly like its parameter)."""
    from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

    files = sorted((f for f in src.iterdir() if f.is_file() and RANK_FILE.search(f.name)),
                   key=lambda f: int(RANK_FILE.search(f.name).group(1)))
    if not files:
        raise CheckpointImportError(f"{src}: no files named like *rank-R-of-N* (XLA FSDP shard files)")
    shards = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
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
        step = _shared_step(optims[0]["state"].values())
        for entry in entries.values():
            if step is not None:
                entry["step"] = step
        state["optim"] = {"state": entries,
                          "param_groups": _named_groups(optims[0]["param_groups"], [names])}
    return state, None, meta["world_size"]


READERS = {"dcp": read_dcp, "deepspeed": read_deepspeed, "xla": read_xla}


def export_hf(path: str | Path, out: str | Path, config: str | Path | None = None) -> Path:
    """Weights as model.safetensors plus config.json, the layout `from_pretrained` reads."""
    from safetensors.torch import save_file

    path, out = resolve(path), Path(out)
    verify_checkpoint(path)
    source = Path(config) if config else path / "hf_config.json"
    if not source.is_file():
        raise CheckpointImportError(f"{path}: no hf_config.json (imported, or saved from a model without a "
                           "Hugging Face config); pass --config CONFIG.json")
    cfg = json.loads(source.read_text())
    weights = read_model(path)
    if cfg.get("tie_word_embeddings") and "lm_head.weight" in weights:
        weights.pop("lm_head.weight")  # tied: from_pretrained points it at the embedding
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
