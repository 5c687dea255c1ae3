"""Checkpoints out to Hugging Face: `polyshard ckpt export --to hf | peft` (docs/checkpoint-format.md).

`--to hf` writes what `save_pretrained` writes at scale: safetensors shards of at most 5 GB with
`model.safetensors.index.json` (one `model.safetensors` when it fits), config.json with the weights'
dtype, generation_config.json for models that generate, and the tokenizer when one is given. It is
streamed: one shard's tensors are read from the checkpoint's DCP files at a time (DCP reads only the
chunks asked for), so memory is one shard, never the model. A LoRA run's checkpoint exports merged
(W + the adapter's delta, by peft's own `merge` on one layer at a time); `--to peft` writes the adapter
alone (adapter_model.safetensors + adapter_config.json, keys as peft's get_peft_model_state_dict names
them) for `PeftModel.from_pretrained` over the base model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from parallel.checkpoint.format.contents import Contents
from parallel.checkpoint.format.directory import resolve
from parallel.checkpoint.hf.hf_files import (  # noqa: F401 - ExportError, DTYPES: this module's API too
    DTYPES,
    MAX_SHARD_BYTES,
    ExportError,
    Reading,
    model_class,
    Weights,
    plain_weights,
    write_hf,
    write_safetensors,
)
from parallel.checkpoint.format.manifest import verify_checkpoint
from parallel.checkpoint.format.safe import UnsafeFileError
from parallel.checkpoint.format.schemas import PeftFile
from parallel.checkpoint.format.tokenizer import check_tokenizer_dir, save_tokenizer
from parallel.checkpoint.state.portable import open_state, read_tensors, tensor_shapes

PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the Hugging Face model


def hf_config_json(model) -> str | None:
    """The config of the Hugging Face model inside `model` (any wrapper, PEFT included), with its
    class as `architectures`, which a model built from a config (not loaded) does not record."""
    for module in (model.modules() if model is not None else ()):
        config = getattr(module, "config", None)
        if hasattr(type(module), "config_class") and hasattr(config, "to_json_string"):
            data = json.loads(config.to_json_string())
            # the library's class: FSDP2 subclasses it in place (FSDPLlamaForCausalLM), which no
            # from_pretrained or export could name
            library = next((c for c in type(module).__mro__
                            if c.__module__.startswith("transformers.")), type(module))
            data["architectures"] = data.get("architectures") or [library.__name__]
            return json.dumps(data, indent=2)
    return None


def peft_module(model):
    """The PEFT model inside `model` (any wrapper) and its active adapter's name, or (None, None)."""
    for module in (model.modules() if model is not None else ()):
        if isinstance(getattr(module, "peft_config", None), dict) and hasattr(module,
                                                                              "active_adapter"):
            active = module.active_adapter
            return module, active if isinstance(active, str) else active[0]
    return None, None


def peft_config_json(model) -> str | None:
    """A PEFT model's adapter configs and active adapter (adapter_config.json's content), or None."""
    module, active = peft_module(model)
    if module is None:
        return None
    adapters = {name: {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.to_dict().items()}
                for name, cfg in module.peft_config.items()}
    return json.dumps({"active": active, "adapters": adapters}, indent=2, default=str)


def export_hf(path: str | Path, out: str | Path, config: str | Path | None = None,
              dtype: str | None = None, tokenizer: str | Path | None = None,
              max_shard_bytes: int = MAX_SHARD_BYTES, part: tuple[int, int] = (0, 1),
              prefix: str | None = None) -> Path:
    """Weights (a LoRA run's merged) as sharded safetensors with config.json, generation config and
    tokenizer: the layout `from_pretrained` reads. `part` (i, n): this process writes the weight
    files i, i + n, ... (engine.save_pretrained: each rank a share, none the whole model); part 0
    also the index, configs and tokenizer. `prefix`: the submodule whose names start with it (a
    policy and its reference held in one module), its names without it. Names that are not the
    config's model's are refused: from_pretrained would start those weights fresh."""
    path, out = resolve(path), Path(out)
    manifest = verify_checkpoint(path)
    files = Contents(path, manifest)
    cfg = _hf_config(files, config)
    dtype_name = dtype or (manifest.get("spec") or {}).get("precision", "fp32")
    if tokenizer:
        check_tokenizer_dir(Path(tokenizer))  # before anything is written
    peft_cfg = _peft_config(files)
    weights = _merged_weights(path, cfg, peft_cfg) if peft_cfg else plain_weights(path, cfg)
    if prefix:
        weights = [(n[len(prefix):], shape, read) for n, shape, read in weights
                   if n.startswith(prefix)]
    _check_names(weights, cfg, prefix)
    write_hf(weights, cfg, dtype_name, out, max_shard_bytes, part)
    if tokenizer and not part[0]:
        save_tokenizer(tokenizer, out)  # as data: no code, no link, names inside OUT (tokenizer.py)
    return out


def export_peft(path: str | Path, out: str | Path, adapter: str | None = None) -> Path:
    """The adapter of a PEFT run, as `PeftModel.save_pretrained` writes it."""
    path, out = resolve(path), Path(out)
    files = Contents(path, verify_checkpoint(path))
    peft_cfg = _peft_config(files)
    if peft_cfg is None:
        raise ExportError(f"{path}: not a PEFT run (no peft_config.json): it has no adapter; export "
                          "it --to hf")
    name = adapter or peft_cfg["active"]
    cfg = _hf_config(files, None)
    model, config = _meta_peft_model(cfg, peft_cfg, name)
    # get_peft_model renamed it after the meta base (no path): the run's own base, as trained, so
    # PeftModel.from_pretrained(adapter) finds it (peft warned "was renamed from ... to ''")
    config.base_model_name_or_path = (peft_cfg["adapters"][name].get("base_model_name_or_path")
                                      or cfg.get("_name_or_path") or None)
    config.inference_mode = True  # as PeftModel.save_pretrained writes it
    from peft.utils import get_peft_model_state_dict

    full = {n: t for n, t in model.state_dict().items()}
    picked = get_peft_model_state_dict(model, state_dict=full, adapter_name=name)
    source = {id(t): n for n, t in full.items()}
    wanted = {f"model.{source[id(t)]}": (tuple(t.shape), t.dtype) for t in picked.values()}
    read = read_tensors(path, wanted, open_state(path))
    tensors = {key: read[f"model.{source[id(t)]}"].contiguous() for key, t in picked.items()}
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "adapter_model.safetensors", tensors)  # the one writer (hf_files)
    config.save_pretrained(str(out))
    return out


def _merged_weights(path: Path, cfg: dict, peft_cfg: dict) -> Weights:
    """The base model's weights with each LoRA layer merged (peft's merge, one layer at a time)."""
    model, _ = _meta_peft_model(cfg, peft_cfg, peft_cfg["active"])
    reader = open_state(path)
    shapes = tensor_shapes(path, "model.", reader)
    out: Weights = []
    tied = cfg.get("tie_word_embeddings")
    for name, (shape, dt) in shapes.items():
        if not name.startswith(PEFT_PREFIX) or ".lora_" in name or ".original_module." in name:
            continue  # the adapter's own tensors (merged below) and modules_to_save's originals
        hf_name = name[len(PEFT_PREFIX):].replace(".base_layer.", ".").replace(
            f".modules_to_save.{peft_cfg['active']}.", ".")
        if tied and hf_name == "lm_head.weight":
            continue
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".base_layer") and leaf == "weight":
            layer = owner[: -len(".base_layer")]
            out.append((hf_name, tuple(shape), _merging(path, model, layer, shapes, reader)))
        else:
            out.append((hf_name, tuple(shape), Reading(path, f"model.{name}", shape, dt, reader)))
    return out


def _merging(path: Path, model, layer: str, shapes: dict, reader) -> Callable[[], torch.Tensor]:
    def merged() -> torch.Tensor:
        module = model.get_submodule(layer)
        module.to_empty(device="cpu", recurse=True)  # this layer only: its base weight and adapter
        names = [n for n, _ in module.named_parameters()]
        wanted = {f"model.{layer}.{n}": (tuple(shapes[f"{layer}.{n}"][0]), shapes[f"{layer}.{n}"][1])
                  for n in names if f"{layer}.{n}" in shapes}
        values = read_tensors(path, wanted, reader)
        with torch.no_grad():
            for n, p in module.named_parameters():
                p.copy_(values[f"model.{layer}.{n}"])
            module.merge(safe_merge=True)
        weight = module.get_base_layer().weight.detach().clone()
        module.to_empty(device="meta", recurse=True)
        return weight
    return merged


def _check_names(weights: Weights, cfg: dict, prefix: str | None) -> None:
    """The exported names sit under the config's model's own top-level parts (`model.`,
    `lm_head.`): a policy and its reference held in one module exported `policy.*` under the
    policy's config, which from_pretrained answered with a freshly initialised model and a
    warning. Only the first part is compared: below it transformers 5 converts names on load (a
    listed MoE's `experts.N.w1` into its fused experts). Unchecked where no transformers class
    builds the config."""
    cls = model_class(cfg)
    if cls is None:
        return
    try:
        config = _config_object(cfg)
        with torch.device("meta"):
            model = cls(config)
    except (ValueError, TypeError, KeyError, AttributeError):
        return
    top = {n.split(".", 1)[0] for n in model.state_dict()}
    unexpected = sorted(n for n, _, _ in weights if n.split(".", 1)[0] not in top)
    if not unexpected and weights:
        return
    heads = sorted({n.split(".", 1)[0] + "." for n in unexpected if "." in n})
    where = f" under --prefix {prefix!r}" if prefix else ""
    raise ExportError(
        f"{len(unexpected)} of the checkpoint's {len(weights)} weights{where} are not under "
        f"{cls.__name__}'s parts ({', '.join(sorted(top))}), e.g. {unexpected[:2]}: "
        "from_pretrained would initialise the model fresh. " + (
            f"To export one submodule, --prefix names it (here: {', '.join(heads[:4])})"
            if heads and not prefix else "Pass --config with the model's own config.json"))


def _config_object(cfg: dict):
    """transformers' config object for the config's data (its dtype left out: the export's own)."""
    import transformers

    data = {k: v for k, v in cfg.items() if k not in ("dtype", "torch_dtype")}
    return transformers.AutoConfig.for_model(data.pop("model_type"), **data)


def _meta_peft_model(cfg: dict, peft_cfg: dict, adapter: str):
    """The run's PEFT model on the meta device (no memory): what peft's own functions need."""
    import peft
    import transformers

    cls = model_class(cfg)
    if cls is None:
        raise ExportError(f"hf_config.json: architectures {str(cfg.get('architectures'))[:80]} "
                          "names no transformers model class; pass --config with the model's "
                          "config.json")
    if adapter not in peft_cfg["adapters"]:
        raise ExportError(f"--adapter {adapter!r}: the run has {sorted(peft_cfg['adapters'])}")
    try:
        config = _config_object(cfg)
        peft_config = peft.PeftConfig.from_peft_type(**peft_cfg["adapters"][adapter])
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise ExportError(f"peft_config.json / hf_config.json: transformers or peft cannot build "
                          f"them ({type(err).__name__}: {str(err)[:200]})") from None
    arch = cls.__name__
    with torch.device("meta"):
        base = getattr(transformers, arch)(config)
        model = peft.get_peft_model(base, peft_config, adapter_name=adapter)
    return model, peft_config


def _hf_config(files: Contents, config: str | Path | None) -> dict:
    """The model's config (the checkpoint's hf_config.json, or --config), as bounded data: a JSON
    object with a model_type, no auto_map (a repository's code), sizes within toy's limits (a
    10**7-layer config would be built, on the meta device, without end)."""
    from parallel.files import load_json
    from parallel.kits.model_limits import model_size_problem

    if config:
        source, data = Path(config), load_json(Path(config), "a model config")
    else:
        source = files.path / "hf_config.json"
        data = files.load_json("hf_config.json", "the model's Hugging Face config")
    if data is None:
        raise ExportError(f"{files.path}: no hf_config.json (imported, or saved from a model "
                          "without a Hugging Face config); pass --config CONFIG.json")
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise UnsafeFileError(f"{source}: a Hugging Face config is a JSON object with a model_type")
    if "auto_map" in data:
        raise UnsafeFileError(f"{source}: auto_map asks for its repository's own code, which "
                              "polyshard never runs")
    problem = model_size_problem(data)
    if problem:
        raise UnsafeFileError(f"{source}: {problem}")
    return data


def _peft_config(files: Contents) -> dict | None:
    """peft_config.json as data (schemas.PeftFile): no module named by it is imported, its patterns
    bounded; None for a run without adapters."""
    return files.load_json("peft_config.json", "the run's adapter configs", PeftFile)


