"""A DeepSpeed JSON as a spec (`polyshard import deepspeed FILE`), keeping what DeepSpeed meant by it.

The rule: every field keeps its meaning, or the import fails naming the field, why, and the fix
(`--lossy` accepts such losses and reports them). "auto" means "decided by the caller" (Hugging Face
fills it from TrainingArguments): polyshard is the caller here, so the spec decides, and the report says
which spec field. An absent field means DeepSpeed's own default, written into the spec explicitly where
polyshard's default differs (gradient_clipping 1.0, pin_memory true, reduction in the compute dtype,
no 16-bit gather on save). Keys the spec has no field for go verbatim under `deepspeed.native`, which
the adapter merges last. Plain data: no deepspeed import (backends/deepspeed/config/schema.py has its rules).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backends.deepspeed.config import schema
from backends.deepspeed.files.import_tp import tensor_parallel_section
from backends.deepspeed.files.import_zero import zero_section
from parallel.interop.importing import Import, Report

LOGGING = {"steps_per_print", "wall_clock_breakdown", "comms_logger", "tensorboard", "wandb",
           "csv_monitor", "comet", "flops_profiler", "memory_breakdown", "timers", "log_level"}


def read_config(path: Path) -> Any:
    """A DeepSpeed config file read as DeepSpeed 0.19.8 reads it: hjson (so `//` comments and
    unquoted keys are allowed), duplicate keys refused. Without hjson (it comes with deepspeed), JSON."""
    from parallel.files import FileError, check_depth, read_text
    from parallel.spec.errors import SpecError

    try:  # a regular file within the size cap: a FIFO or /dev/zero would hang or fill memory
        text = read_text(path, "a DeepSpeed config")
    except FileError as err:
        raise SpecError([(str(path), str(err).partition(": ")[2])]) from None
    try:
        import hjson
    except ImportError:
        hjson = None
    try:
        if hjson is None:
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        else:
            data = hjson.loads(text, object_pairs_hook=_no_duplicates)
        check_depth(data, path, "a DeepSpeed config")
        return data
    except RecursionError:
        raise SpecError([(str(path), "is nested too deeply to parse")]) from None
    except FileError as err:
        raise SpecError([(str(path), str(err).partition(": ")[2])]) from None
    except (ValueError, OverflowError) as err:  # decode errors; hjson overflows on 1e999
        raise SpecError([(str(path), f"is not a DeepSpeed config DeepSpeed could read: {err}")]) \
            from None


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"duplicate keys {twice} (DeepSpeed refuses them)")
    return dict(pairs)


def from_deepspeed_file(path: Path, lossy: bool, given: dict, validate):
    """`polyshard import deepspeed FILE`: the file read as DeepSpeed reads it, then from_deepspeed."""
    return from_deepspeed(read_config(path), lossy, given, validate=validate)


def from_deepspeed(cfg: Any, lossy: bool = False, given: dict | None = None, *,
                   validate) -> tuple[dict, Report]:
    """DeepSpeed config (a dict, as DeepSpeed's hjson reader gives it) -> (spec dict, report).
    `given`: spec fields set on the command line (they decide "auto" and derived values);
    `validate`: the spec validation the result must pass (load_spec). Raises SpecError listing every
    field that cannot keep its meaning."""
    imp = Import(lossy, given or {}, validate)
    import_into(imp, cfg)
    return imp.finish()


def import_into(imp: Import, cfg: Any, caller: str = "polyshard") -> None:
    """Map `cfg` into `imp`. `caller` fills "auto": polyshard (the spec decides), or accelerate
    (a deepspeed_config_file under accelerate: clipping 1.0 and no 16-bit gather, as its Accelerator
    fills them)."""
    if not isinstance(cfg, dict):
        imp.problems.append(("<file>", f"a DeepSpeed config is a JSON object, not "
                             f"{type(cfg).__name__}"))
        return
    imp.spec["backend"] = "deepspeed"
    imp.caller = caller
    for key, value in cfg.items():
        if key not in schema.TOP_LEVEL:
            _unknown(imp, key)
        elif key not in HANDLED:
            _native(imp, key, value)
    _batch(imp, cfg, _sequence_parallel(imp, cfg))
    tensor_parallel_section(imp, cfg.get("tensor_parallel"))
    _clipping(imp, cfg)
    _precision(imp, cfg)
    zero_section(imp, cfg.get("zero_optimization"))
    _reduction(imp, cfg)
    for block in ("optimizer", "scheduler"):
        if block in cfg:
            _client_block(imp, block, cfg[block])
    if "zero_allow_untested_optimizer" in cfg:
        imp.note("zero_allow_untested_optimizer", "ignored", "polyshard always hands DeepSpeed "
                 "your optimizer and allows it")
    _cpu_optimizer(imp, cfg)


def _cpu_optimizer(imp: Import, cfg: dict) -> None:
    """zero_force_ds_cpu_optimizer (default true): with optimizer offload, DeepSpeed refuses a client
    optimizer and builds DeepSpeedCPUAdam from its optimizer block, and accelerate swaps the script's
    torch Adam/AdamW for DeepSpeedCPUAdam (map_pytorch_optim_to_deepspeed): either way the job runs
    DeepSpeed's CPU Adam, which is deepspeed.cpu_adam: true."""
    key, force = "zero_force_ds_cpu_optimizer", cfg.get("zero_force_ds_cpu_optimizer", True)
    if not isinstance(force, bool):
        imp.problems.append((key, f"{force!r} is not true or false"))
    elif imp.spec.get("offload", "none") != "none":
        imp.set("deepspeed.cpu_adam", force, key, "mapped" if key in cfg else "default",
                f"deepspeed.cpu_adam: {str(force).lower()}: with offload DeepSpeed and accelerate "
                + ("run DeepSpeedCPUAdam in place of the script's Adam/AdamW" if force else
                   "keep the script's optimizer") + ("" if key in cfg else " (absent: true)"))
    elif key in cfg:
        imp.note(key, "ignored", "read only with optimizer offload, which this file does not turn on")


def _unknown(imp: Import, key: str) -> None:
    hint = schema.closest(key, schema.TOP_LEVEL)
    if hint:
        imp.problems.append((key, f"DeepSpeed 0.19.8 reads no such key and ignores it silently: did "
                             f"you mean {hint!r}? Fix the name or remove it"))
    else:
        imp.note(key, "ignored", "DeepSpeed 0.19.8 does not read this key: it had no effect there "
                 "and has none here")


def _native(imp: Import, key: str, value) -> None:
    if _has_auto(value):
        imp.problems.append((key, "holds \"auto\", which only the fields polyshard decides take "
                             "(batch sizes, clipping, precision, buckets); give a value"))
        return
    imp.set(f"deepspeed.native.{key}", value, key, "native",
            "logging only, kept for DeepSpeed" if key in LOGGING else "kept verbatim for DeepSpeed")


def _has_auto(value) -> bool:
    if isinstance(value, dict):
        return any(_has_auto(v) for v in value.values())
    return value == "auto"




def _sequence_parallel(imp: Import, cfg: dict) -> int:
    """sequence_parallel_size N (DeepSpeed's Ulysses, the group UlyssesSPAttentionHF splits each
    row over) is topology.cp N: polyshard runs its own Ulysses on every backend. DeepSpeed then
    counts world / N data-parallel ranks in train_batch_size (DeepSpeedConfig, without an mpu), as
    global_batch_size counts world / (tp x cp). Returns N (1 when absent)."""
    if "sequence_parallel_size" not in cfg:
        return 1
    size = imp.whole("sequence_parallel_size", cfg["sequence_parallel_size"])
    if size is None or size < 1:
        imp.problems.append(("sequence_parallel_size", f"{cfg['sequence_parallel_size']!r}: a "
                             "whole number of ranks, 1 or more"))
        return 1
    if size > 1:
        imp.set("topology.cp", size, "sequence_parallel_size", "mapped",
                f"topology.cp: {size} (each row split over {size} ranks: polyshard's Ulysses, "
                "an all-to-all around the model's attention, as UlyssesSPAttentionHF)")
    return size


def _batch(imp: Import, cfg: dict, sp: int = 1) -> None:
    """micro batch, accumulation, global batch: DeepSpeed derives a missing one from the others and
    the world size over sequence_parallel_size (DeepSpeedConfig._set_batch_related_parameters); so
    does this import."""
    fields = {"train_micro_batch_size_per_gpu": "micro_batch_size",
              "gradient_accumulation_steps": "grad_accum_steps",
              "train_batch_size": "global_batch_size"}
    values = {}
    for key, field in fields.items():
        value = cfg.get(key)
        if value == "auto" or value is None:
            imp.note(key, "auto" if value == "auto" else "absent",
                     f"decided by the spec ({field})" if value == "auto" else
                     f"derived as DeepSpeed derives it, or the spec's {field}")
            continue
        values[field] = imp.whole(key, value)
    if None in values.values():
        return
    nodes = imp.given_value("topology.nodes") or 1
    world = nodes * (imp.given_value("topology.procs_per_node") or 1) // sp
    mb, ga, gb = (values.get(f) for f in ("micro_batch_size", "grad_accum_steps", "global_batch_size"))
    if gb is not None and (mb is None or ga is None):
        if mb is None and ga is None:
            ga = 1
        if mb is None:
            mb = gb // (ga * world)
        else:
            ga = gb // (mb * world)
        imp.note("train_batch_size", "derived", f"micro_batch_size {mb}, grad_accum_steps {ga} at "
                 f"world size {world} (pass --set topology.* for another world size)")
    for field, value in (("micro_batch_size", mb), ("grad_accum_steps", ga),
                         ("global_batch_size", gb)):
        if value is not None:
            imp.set(field, value, next(k for k, f in fields.items() if f == field))


def _clipping(imp: Import, cfg: dict) -> None:
    value = cfg.get("gradient_clipping")
    if value == "auto" and imp.caller == "accelerate":
        imp.set("grad_clip", 1.0, "gradient_clipping", "auto", "auto: accelerate fills 1.0")
    elif value == "auto":
        imp.note("gradient_clipping", "auto", "decided by the spec (grad_clip: unset is off; "
                 "accelerate and HF Trainer would fill 1.0: --set grad_clip=1.0 for that)")
    elif value is None:
        imp.set("grad_clip", schema.DEFAULTS["gradient_clipping"], "gradient_clipping", "default",
                "absent: DeepSpeed's default 1.0, written as grad_clip: 1.0")
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        imp.set("grad_clip", float(value) if value > 0 else None, "gradient_clipping")
    else:
        imp.problems.append(("gradient_clipping", f"{value!r} is not a number >= 0"))


def _enabled(block) -> Any:
    if block is None:
        return None
    return block.get("enabled", False) if isinstance(block, dict) else block


def _precision(imp: Import, cfg: dict) -> None:
    bf16_key = "bf16" if "bf16" in cfg else "bfloat16"
    for key, fields in (("fp16", schema.FP16_FIELDS), (bf16_key, schema.BF16_FIELDS)):
        block = cfg.get(key)
        for sub in (block or {}) if isinstance(block, dict) else ():
            if sub not in fields:
                hint = schema.closest(sub, fields)
                imp.problems.append((f"{key}.{sub}", "is no DeepSpeed setting (its parser refuses "
                                     "it)" + (f"; did you mean {hint!r}?" if hint else "")))
    fp16, bf16 = _enabled(cfg.get("fp16")), _enabled(cfg.get(bf16_key))
    if fp16 is True and bf16 is True:
        imp.problems.append(("fp16.enabled", f"true together with {bf16_key}.enabled true: "
                             "DeepSpeed refuses both; enable one"))
        return
    chosen = "fp16" if fp16 is True else "bf16" if bf16 is True else None
    if chosen:
        imp.set("precision", chosen, f"{'fp16' if chosen == 'fp16' else bf16_key}.enabled")
    elif "auto" in (fp16, bf16):
        imp.note("fp16.enabled / bf16.enabled", "auto", "decided by the spec (precision: fp32 "
                 "unless you --set precision=bf16 or fp16)")
    else:
        imp.set("precision", "fp32", "fp16.enabled / bf16.enabled", "default",
                "neither enabled: fp32, DeepSpeed's default")
    precision = imp.given_value("precision") or chosen
    _fp16_knobs(imp, cfg.get("fp16") if isinstance(cfg.get("fp16"), dict) else {}, precision)
    bf16_block = cfg.get(bf16_key) if isinstance(cfg.get(bf16_key), dict) else {}
    if bf16_block.get("bf16_master_weights_and_grads") or bf16_block.get("bf16_optimizer_states"):
        imp.refuse(f"{bf16_key}.bf16_master_weights_and_grads", "keeps master weights or optimizer "
                   "state in bf16; polyshard keeps them fp32 on every backend")
    extra = {k: v for k, v in bf16_block.items() if k in ("immediate_grad_update",)}
    if extra:
        imp.set("deepspeed.native.bf16", extra, f"{bf16_key}.immediate_grad_update", "native")


FP16_KNOBS = {"initial_scale_power": "initial_scale_power", "loss_scale_window": "growth_interval",
              "hysteresis": "hysteresis", "min_loss_scale": "min_scale"}
FP16_DEFAULTS = {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                 "min_loss_scale": 1}


def _fp16_knobs(imp: Import, block: dict, precision: str | None) -> None:
    if block.get("loss_scale", 0) != 0:
        imp.refuse("fp16.loss_scale", f"{block['loss_scale']!r} is a static loss scale; polyshard "
                   "scales dynamically on every backend: use 0")
    if block.get("fp16_master_weights_and_grads"):
        imp.refuse("fp16.fp16_master_weights_and_grads", "keeps master weights in fp16; polyshard "
                   "keeps them fp32 on every backend: set it false")
    own = {k: block[k] for k in ("auto_cast", "consecutive_hysteresis") if block.get(k)}
    if own:  # DeepSpeed-only fp16 details (auto_cast: cast floating inputs to fp16)
        imp.set("deepspeed.native.fp16", dict(own), "fp16." + "/".join(own), "native",
                f"kept verbatim for DeepSpeed: {own}")
    knobs = {k: block[k] for k in FP16_KNOBS if k in block and block[k] != FP16_DEFAULTS[k]}
    if not knobs:
        return
    if precision != "fp16":  # inert while fp16 is off; a contradiction is reported if it is turned on
        imp.set("deepspeed.native.fp16", {**own, **knobs}, "fp16." + "/".join(knobs), "native",
                "kept for DeepSpeed, where they apply only when fp16 is on (--set precision=fp16 "
                "at import makes them loss_scale fields)")
        return
    for key, value in knobs.items():
        imp.set(f"loss_scale.{FP16_KNOBS[key]}", value, f"fp16.{key}")


def _reduction(imp: Import, cfg: dict) -> None:
    value = cfg.get("communication_data_type")
    if value is None:
        imp.set("reduce_dtype", "compute", "communication_data_type", "default",
                "absent: DeepSpeed reduces gradients in the compute dtype (reduce_dtype: compute)")
    elif str(value).lower() in ("fp32", "bf16", "fp16"):
        imp.set("reduce_dtype", str(value).lower(), "communication_data_type")
    else:
        imp.problems.append(("communication_data_type", f"{value!r}: DeepSpeed takes fp32, bf16 or "
                             "fp16"))


def _client_block(imp: Import, block: str, value) -> None:
    """polyshard builds the optimizer and scheduler the script passes to engine.prepare(), on every
    backend (DeepSpeed silently ignores these blocks when a script passes its own). A block whose
    settings are all "auto" leaves them to the caller, which is that script; one with values would
    lose them."""
    kind = value.get("type", "?") if isinstance(value, dict) else "?"
    params = (value.get("params") or {}) if isinstance(value, dict) else {}
    # DeepSpeed's AdamW with torch_adam / adam_w_mode true is torch.optim.AdamW itself
    same_as_torch = {"torch_adam": True, "adam_w_mode": True} if str(kind).lower() == "adamw" else {}
    params = {k: v for k, v in params.items() if same_as_torch.get(k) is not v}
    if all(v == "auto" for v in params.values()) and set(value) <= {"type", "params"}:
        imp.note(block, "auto", f"{kind} with every setting \"auto\": decided by the caller, "
                 f"which is your script: pass it to engine.prepare() ({_python_hint(block, value)})")
        return
    imp.refuse(block, f"a DeepSpeed {block} block with values ({kind}, {params}) builds a "
               f"DeepSpeed-only {block}; polyshard uses the one your script passes to "
               f"engine.prepare() on every backend. Pass {_python_hint(block, value)} there and "
               "remove the block")


def _python_hint(block: str, value) -> str:
    if not isinstance(value, dict):
        return "see the DeepSpeed docs"
    params = {k: v for k, v in (value.get("params") or {}).items() if v != "auto"}
    kind = str(value.get("type", "?")).lower()
    if block == "optimizer" and kind in ("adamw", "adam", "sgd"):
        # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false (ADAM_W_MODE_DEFAULT
        # True); its "AdamW" always does; torch_adam and adam_w_mode are no torch arguments
        decoupled = kind == "adamw" or params.get("adam_w_mode", True) is not False
        cls = "SGD" if kind == "sgd" else "AdamW" if decoupled else "Adam"
        torch_params = {k: v for k, v in params.items() if k not in DEEPSPEED_ONLY}
        return f"optimizer=(torch.optim.{cls}, {torch_params})"
    if block == "optimizer" and kind == "muon":  # DeepSpeed's MuonWithAuxAdam: muon_lr / adam_lr
        return _muon_hint(params)
    return f"{block} {kind} with {params}"


def _muon_hint(params: dict) -> str:
    """DeepSpeed's Muon block as polyshard's recipe: torch.optim.Muon on the hidden matrices (its
    update is not DeepSpeed's own: docs/optimizers.md), AdamW on the rest, each half's settings."""
    shared = {k: params[k] for k in ("lr", "weight_decay") if k in params}
    muon = {**shared, **{k: params[k] for k in ("momentum",) if k in params}}
    adamw = {**shared, **{k: params[k] for k in ("betas", "eps") if k in params}}
    muon.update({"lr": params["muon_lr"]} if "muon_lr" in params else {})
    adamw.update({"lr": params["adam_lr"]} if "adam_lr" in params else {})
    return (f"optimizer=muon_with_adamw(muon={muon}, adamw={adamw}) with "
            "param_groups=hidden_matrices() (parallel.engine.model.optim.recipes; torch.optim.Muon, "
            "whose update differs from DeepSpeed's own Muon: docs/optimizers.md)")


DEEPSPEED_ONLY = {"torch_adam", "adam_w_mode"}  # DeepSpeed's switches, no torch arguments
HANDLED = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
           "tensor_parallel", "sequence_parallel_size",
           "gradient_clipping", "fp16", "bf16", "bfloat16", "zero_optimization",
           "communication_data_type", "optimizer", "scheduler", "zero_allow_untested_optimizer",
           "zero_force_ds_cpu_optimizer"}
