"""save_pretrained's one route to the Hugging Face files (engine.checkpoints.save_pretrained): the
backend's portable save of the model, captured (no file written), each rank's pieces then written in
place in their files (hf/hf_gather.py). A plain model's files are save_pretrained's (model-*.safetensors,
the index, config.json, generation config); a PEFT run's, PeftModel.save_pretrained's for its active
adapter (adapter_model.safetensors in fp32, adapter_config.json), picked and named by peft's own
get_peft_model_state_dict. Where the process group cannot sum host tensors (torch_xla's), the counts
travel over a gloo group of the checkpointer's own."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist

from parallel.checkpoint.hf.export import hf_config_json, peft_module


def hf_config(model) -> dict:
    cfg = hf_config_json(model)
    if cfg is None:
        raise ValueError("save_pretrained / checkpoint.hf_at_end: the model has no Hugging Face "
                         "config (not a transformers model); use save()")
    return json.loads(cfg)


def collective(world: int, side) -> tuple[torch.device, object]:
    """(device, group) save_pretrained's few collectives run on: CUDA over NCCL, host memory over
    gloo, else host memory over `side()` (a gloo group, made once by the caller)."""
    if world == 1:
        return torch.device("cpu"), None
    backend = str(dist.get_backend())
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device()), None
    return torch.device("cpu"), (None if "gloo" in backend else side())


def save(engine, write, out: Path, max_shard_bytes: int | None, durable: bool, side) -> None:
    """`write(sink)`: the backend's portable save, here of the model section into a Capture (DCP
    plans it; no file is written), whose pieces write_gathered writes in place; the main rank then
    writes the index and configs."""
    from parallel.checkpoint.hf.capture import Capture, CaptureSink
    from parallel.checkpoint.hf.hf_files import weight_dtype, write_configs, write_index
    from parallel.checkpoint.hf.hf_gather import shared_shapes, write_gathered

    device, group = collective(engine.world_size, side)
    cfg, (peft, active) = hf_config(engine.model), peft_module(engine.model)
    engine.check_finite(wait=True)
    capture = Capture()
    write(CaptureSink(out, capture))
    stored = [k[len("model."):] for k in shared_shapes(capture, engine.world_size, group)
              if k.startswith("model.")]
    if peft is not None:
        names, config = adapter_names(peft, active, stored)
        dtype, single = torch.float32, "adapter_model.safetensors"  # as peft saves an fp32 run's
    else:
        tied = cfg.get("tie_word_embeddings") and "lm_head.weight" in stored
        names = {k: k for k in stored if not (tied and k == "lm_head.weight")}
        dtype, single = weight_dtype(engine.spec.compute), None
    files = write_gathered(capture, names, dtype, out, max_shard_bytes, engine.rank,
                           engine.world_size, device, durable, single, group)
    if engine.is_main and peft is not None:
        config.save_pretrained(str(out))
    elif engine.is_main:
        write_index(out, files, dtype.itemsize)
        write_configs(cfg, dtype, out)


def adapter_names(peft_model, name: str, stored: list[str]) -> tuple[dict[str, str], object]:
    """Adapter `name`'s tensors as PeftModel.save_pretrained names them (portable name -> key in
    adapter_model.safetensors), picked by peft's own get_peft_model_state_dict over stand-ins of the
    stored names, and its config as save_pretrained writes it (inference_mode)."""
    from peft.utils import get_peft_model_state_dict

    stand_ins = {k: torch.empty(0) for k in stored}
    picked = get_peft_model_state_dict(peft_model, state_dict=stand_ins, adapter_name=name)
    source = {id(t): k for k, t in stand_ins.items()}
    config = copy.deepcopy(peft_model.peft_config[name])
    config.inference_mode = True
    return {source[id(t)]: key for key, t in picked.items()}, config
