"""Configs people already have, in and out: `accelerate config` files and DeepSpeed JSON become specs
(`polyshard import`), and a spec becomes an accelerate config, a DeepSpeed JSON or HF
`TrainingArguments` keyword arguments (`polyshard export`). Every source field is reported: mapped to
a spec field, a launch flag, ignored (with why), or unsupported (with why). Plain data, no imports of
accelerate, deepspeed or transformers."""

from __future__ import annotations

from typing import Any

from parallel.specio import SpecError

STRATEGIES = {"FULL_SHARD": "full", "SHARD_GRAD_OP": "grad_op", "NO_SHARD": "none",
              "HYBRID_SHARD": "hybrid", "HYBRID_SHARD_ZERO2": "hybrid_grad_op"}
BY_NUMBER = dict(zip("12345", STRATEGIES))  # accelerate's menu numbers 1-5
PRECISION = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
PREFETCH = {"BACKWARD_PRE": "backward_pre", "BACKWARD_POST": "backward_post", "NO_PREFETCH": "none"}
FSDP_BOOLS = {"fsdp_forward_prefetch": "fsdp.forward_prefetch",
              "fsdp_sync_module_states": "fsdp.sync_module_states",
              "fsdp_cpu_ram_efficient_loading": "fsdp.cpu_ram_efficient_loading",
              "fsdp_use_orig_params": "fsdp.use_orig_params",
              "fsdp_activation_checkpointing": "activation_checkpointing"}
LAUNCH = {"machine_rank": "--node-rank", "main_process_ip": "--rdzv-endpoint HOST",
          "main_process_port": "--rdzv-endpoint :PORT", "rdzv_backend": "torchrun's c10d rendezvous",
          "same_network": "torchrun's rendezvous"}
IGNORED = {"compute_environment": "polyshard launches locally or emits cluster files itself",
           "debug": "not a training setting", "main_training_function": "notebooks only",
           "tpu_env": "TPU VM env: `polyshard launch --emit tpu-vm`",
           "tpu_use_cluster": "`polyshard launch --emit tpu-vm` targets every worker",
           "tpu_use_sudo": "not a training setting", "use_cpu": "the device follows the host",
           "gpu_ids": "set CUDA_VISIBLE_DEVICES", "enable_cpu_affinity": "not a training setting",
           "dynamo_config": "torch.compile is outside the spec"}
STAGE_SHARD = {0: "none", 1: "optimizer", 2: "grad_op", 3: "full"}

Report = list[tuple[str, str, str]]  # (source field, outcome, detail)


def _stage(path: str, value) -> str:
    if str(value) not in {"0", "1", "2", "3"}:
        raise SpecError([(path, f"{value!r} is no ZeRO stage; use 0, 1, 2 or 3")])
    return STAGE_SHARD[int(value)]


def _set(spec: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        spec = spec.setdefault(p, {})
    spec[leaf] = value


def from_accelerate(cfg: dict, read_json=None) -> tuple[dict, Report]:
    """An `accelerate config` YAML (as a dict) -> (spec dict, report)."""
    spec: dict = {}
    report: Report = []
    fsdp = dict(cfg.get("fsdp_config") or {})
    xla = cfg.get("xla", fsdp.pop("xla", False))
    kind = cfg.get("distributed_type", "NO")
    if kind == "DEEPSPEED":
        spec["backend"] = "deepspeed"
    elif kind in ("FSDP", "XLA"):
        spec["backend"] = "xla_fsdp" if (xla or kind == "XLA") else "fsdp"
    else:
        report.append(("distributed_type", "unsupported", f"{kind!r}: polyshard runs FSDP, "
                       "DEEPSPEED or XLA jobs"))
    report.append(("distributed_type", "mapped", f"backend: {spec.get('backend')}"))
    for key, value in cfg.items():
        if key in ("fsdp_config", "deepspeed_config", "distributed_type", "xla"):
            continue
        report.append(_top_level(spec, key, value, cfg))
    for key, value in fsdp.items():
        report.append(_fsdp_field(spec, key, value))
    if spec.get("backend") == "fsdp" and "fsdp_version" not in fsdp:
        _set(spec, "fsdp.version", 1)  # what accelerate runs when the file does not say
        report.append(("fsdp_config.fsdp_version", "mapped", "absent: fsdp.version: 1, accelerate's "
                       "default"))
    if xla:
        report.append(("xla", "mapped", "backend: xla_fsdp"))
    ds = dict(cfg.get("deepspeed_config") or {})
    if "deepspeed_config_file" in ds and read_json is not None:
        file_spec, file_report = from_deepspeed(read_json(ds.pop("deepspeed_config_file")))
        spec = {**file_spec, **spec}
        report += [(f"deepspeed_config_file: {k}", o, d) for k, o, d in file_report]
    for key, value in ds.items():
        report.append(_ds_field(spec, key, value))
    return spec, report


def _top_level(spec: dict, key: str, value, cfg: dict) -> tuple[str, str, str]:
    if key == "mixed_precision":
        if value not in PRECISION:
            return key, "unsupported", f"{value!r}: polyshard runs fp32, bf16, fp16"
        spec["precision"] = PRECISION[value]
        return key, "mapped", f"precision: {PRECISION[value]}"
    if key in ("num_processes", "num_machines"):
        nodes = int(cfg.get("num_machines", 1))
        _set(spec, "topology.nodes", nodes)
        _set(spec, "topology.procs_per_node", int(cfg.get("num_processes", 1)) // nodes)
        return key, "mapped", "topology (accelerate's num_processes counts all machines)"
    if key == "downcast_bf16":
        if value in ("no", False):
            return key, "ignored", "'no' is polyshard's behaviour (fp32 master weights)"
        return key, "unsupported", "TPU bf16 downcasting of fp32 tensors changes the math"
    if key in LAUNCH:
        return key, "launch flag", f"polyshard launch {LAUNCH[key]}"
    if key in IGNORED:
        return key, "ignored", IGNORED[key]
    if key in ("xla_fsdp_settings", "xla_fsdp_grad_ckpt", "xla_fsdp_v2"):
        return _fsdp_field(spec, key, value)
    return key, "unsupported", "unknown to polyshard; nothing was set"


def _fsdp_field(spec: dict, key: str, value) -> tuple[str, str, str]:
    key_in = f"fsdp_config.{key}"
    if key == "fsdp_sharding_strategy":
        name = BY_NUMBER.get(str(value), str(value).upper())
        if name not in STRATEGIES:
            return key_in, "unsupported", f"{value!r} is no FSDP strategy (1-5 or a name)"
        spec["shard"] = STRATEGIES[name]
        return key_in, "mapped", f"shard: {STRATEGIES[name]}"
    if key == "fsdp_offload_params":
        spec["offload"] = "params" if value else "none"
        return key_in, "mapped", f"offload: {spec['offload']}"
    if key == "fsdp_auto_wrap_policy":
        policy = {"TRANSFORMER_BASED_WRAP": "layer_classes", "SIZE_BASED_WRAP": "size",
                  "NO_WRAP": "none"}.get(value)
        if policy is None:
            return key_in, "unsupported", f"{value!r}"
        _set(spec, "wrap.policy", spec.get("wrap", {}).get("policy", policy))
        return key_in, "mapped", f"wrap.policy: {policy}"
    if key == "fsdp_transformer_layer_cls_to_wrap":
        classes = value if isinstance(value, list) else [c.strip() for c in str(value).split(",")]
        _set(spec, "wrap.layer_classes", classes)
        _set(spec, "wrap.policy", "layer_classes")
        return key_in, "mapped", f"wrap.layer_classes: {classes}"
    if key == "fsdp_min_num_params":
        _set(spec, "wrap.min_num_params", int(value))
        return key_in, "mapped", "wrap.min_num_params"
    if key in ("fsdp_backward_prefetch_policy", "fsdp_backward_prefetch"):
        _set(spec, "fsdp.backward_prefetch", PREFETCH.get(str(value).upper(), "none"))
        return key_in, "mapped", f"fsdp.backward_prefetch: {PREFETCH.get(str(value).upper())}"
    if key == "fsdp_state_dict_type":
        spec["state_dict"] = "full" if "FULL" in str(value).upper() else "sharded"
        return key_in, "mapped", f"state_dict: {spec['state_dict']}"
    if key == "fsdp_version":
        _set(spec, "fsdp.version", int(value))
        return key_in, "mapped", f"fsdp.version: {value}"
    if key in FSDP_BOOLS:
        _set(spec, FSDP_BOOLS[key], bool(value))
        return key_in, "mapped", FSDP_BOOLS[key]
    if key == "xla_fsdp_settings":
        _set(spec, "xla.xla_fsdp_settings", dict(value or {}))
        return key_in, "mapped", "xla.xla_fsdp_settings"
    if key == "xla_fsdp_grad_ckpt":
        _set(spec, "xla.xla_fsdp_grad_ckpt", bool(value))
        return key_in, "mapped", "xla.xla_fsdp_grad_ckpt"
    if key == "xla_fsdp_v2":
        _set(spec, "xla.fsdp_version", 2 if value else 1)
        return key_in, "mapped", "xla.fsdp_version"
    return key_in, "unsupported", "unknown to polyshard; nothing was set"


def _ds_field(spec: dict, key: str, value) -> tuple[str, str, str]:
    key_in = f"deepspeed_config.{key}"
    if key == "zero_stage":
        spec["shard"] = _stage(key_in, value)
        return key_in, "mapped", f"shard: {spec['shard']}"
    if key in ("offload_optimizer_device", "offload_param_device"):
        if value in ("none", None):
            return key_in, "mapped", "no offload"
        if value == "nvme":
            return key_in, "unsupported", "NVMe offload: set it under deepspeed.native"
        level = "params" if key == "offload_param_device" else "optimizer"
        spec["offload"] = "params" if "params" in (spec.get("offload"), level) else level
        return key_in, "mapped", f"offload: {spec['offload']}"
    if key == "gradient_accumulation_steps":
        spec["grad_accum_steps"] = int(value)
        return key_in, "mapped", "grad_accum_steps"
    if key == "gradient_clipping":
        spec["grad_clip"] = float(value) if float(value) > 0 else None
        return key_in, "mapped", "grad_clip"
    if key == "zero3_init_flag":
        _set(spec, "deepspeed.zero_init", bool(value))
        return key_in, "mapped", "deepspeed.zero_init"
    return key_in, "unsupported", "unknown to polyshard; nothing was set"


def from_deepspeed(cfg: dict) -> tuple[dict, Report]:
    """A DeepSpeed JSON config -> (spec dict, report). "auto" means "let the spec decide": the field
    keeps polyshard's default and is reported so."""
    spec: dict = {"backend": "deepspeed"}
    report: Report = []
    simple = {"train_micro_batch_size_per_gpu": "micro_batch_size",
              "gradient_accumulation_steps": "grad_accum_steps", "gradient_clipping": "grad_clip"}
    for key, value in cfg.items():
        if value == "auto":
            report.append((key, "auto", "decided by the spec (polyshard's default or --set)"))
        elif key in simple:
            spec[simple[key]] = (None if key == "gradient_clipping" and float(value) == 0
                                 else value)
            report.append((key, "mapped", simple[key]))
        elif key in ("bf16", "fp16"):
            if _enabled(value):
                spec["precision"] = key
            report.append((key, "mapped", "precision"))
        elif key == "zero_optimization":
            report += _zero_section(spec, value)
        elif key in ("train_batch_size", "steps_per_print", "wall_clock_breakdown"):
            report.append((key, "ignored", "derived from the spec or logging only"))
        else:
            _set(spec, f"deepspeed.native.{key}", value)
            report.append((key, "native", "kept verbatim under deepspeed.native"))
    return spec, report


def _enabled(value) -> bool:
    return bool(value.get("enabled", False)) if isinstance(value, dict) else bool(value)


def _zero_section(spec: dict, zero: dict) -> Report:
    report: Report = []
    for key, value in zero.items():
        path = f"zero_optimization.{key}"
        if value == "auto":
            report.append((path, "auto", "decided by the spec"))
        elif key == "stage":
            spec["shard"] = _stage(path, value)
            report.append((path, "mapped", f"shard: {spec['shard']}"))
        elif key in ("offload_optimizer", "offload_param") and isinstance(value, dict):
            device = value.get("device", "none")
            outcome = _ds_field(spec, f"{key}_device", device)
            report.append((path, outcome[1], outcome[2]))
        elif key in ("reduce_bucket_size", "prefetch_bucket_size"):
            _set(spec, f"deepspeed.{key}", int(value))
            report.append((path, "mapped", f"deepspeed.{key}"))
        elif key == "stage3_param_persistence_threshold":
            _set(spec, "deepspeed.param_persistence_threshold", int(value))
            report.append((path, "mapped", "deepspeed.param_persistence_threshold"))
        else:
            _set(spec, f"deepspeed.native.zero_optimization.{key}", value)
            report.append((path, "native", "kept verbatim under deepspeed.native"))
    return report
