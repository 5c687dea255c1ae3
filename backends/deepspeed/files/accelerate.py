"""An accelerate YAML's `deepspeed_config` as a spec, meaning what accelerate 1.11's DeepSpeedPlugin and
Accelerator make of it (measured with accelerate's own launcher and plugin in
tests/unit/test_real_configs.py):

- without `deepspeed_config_file`, the plugin builds a config: ZeRO stage 2 when zero_stage is absent,
  the offload devices, gradient_accumulation_steps (1), gradient_clipping ("auto", which Accelerator
  fills with 1.0), no 16-bit gather on save, zero.Init on at stage 3 unless zero3_init_flag says
  otherwise; mixed_precision fp16 adds `auto_cast: true`;
- with `deepspeed_config_file`, the JSON decides (its "auto" values filled by accelerate: precision
  from mixed_precision, clipping 1.0, no 16-bit gather), and the other yaml keys must agree with it.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from backends.deepspeed.files.import_zero import SHARD_OF_STAGE, zero_section
from backends.deepspeed.files.interop import import_into, read_config
from parallel.interop.importing import Import, parallelism_sizes

PLUGIN_KEYS = {"zero_stage", "offload_optimizer_device", "offload_param_device",
               "offload_optimizer_nvme_path", "offload_param_nvme_path",
               "gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag",
               "zero3_save_16bit_model", "deepspeed_config_file"}
LAUNCH_KEYS = {"deepspeed_multinode_launcher": "polyshard launch starts torchrun on every node "
               "(--emit slurm writes the job)", "deepspeed_hostfile": "hosts: polyshard launch "
               "--nnodes / --emit slurm", "deepspeed_inclusion_filter": "hosts: polyshard launch",
               "deepspeed_exclusion_filter": "hosts: polyshard launch"}


def claims(kind: str, cfg: dict) -> int:
    return 1 if kind == "DEEPSPEED" else 0


def section(imp: Import, cfg: dict, base) -> None:
    deepspeed_section(imp, dict(cfg.get("deepspeed_config") or {}), cfg, base)


def deepspeed_section(imp: Import, ds: dict, cfg: dict, base) -> None:
    imp.set("backend", "deepspeed", "distributed_type")
    for key, value in ds.items():
        if key in LAUNCH_KEYS:
            imp.note(f"deepspeed_config.{key}", "launch", LAUNCH_KEYS[key])
        elif key == "deepspeed_moe_layer_cls_names" and value:
            imp.refuse(f"deepspeed_config.{key}", "mixture-of-experts layers have no polyshard "
                       "equivalent")
        elif key not in PLUGIN_KEYS and key != "deepspeed_moe_layer_cls_names":
            hint = difflib.get_close_matches(key, sorted(PLUGIN_KEYS | set(LAUNCH_KEYS)), n=1,
                                             cutoff=0.75)
            if hint:
                imp.problems.append((f"deepspeed_config.{key}", f"accelerate does not read it; "
                                     f"did you mean {hint[0]!r}?"))
            else:
                imp.note(f"deepspeed_config.{key}", "ignored", "accelerate does not read it")
    if ds.get("deepspeed_config_file"):
        _from_file(imp, ds, base)
    else:
        _from_plugin(imp, ds)
    _parallelism(imp, parallelism_sizes(imp, cfg.get("parallelism_config") or {}))
    _autotp_world(imp)
    stage3 = imp.spec.get("shard") in ("full", "hybrid")
    flag = ds.get("zero3_init_flag")
    imp.set("deepspeed.zero_init", bool(stage3 if flag is None else flag and stage3),
            "deepspeed_config.zero3_init_flag", "mapped" if flag is not None else "default",
            "zero.Init" + (" (absent: on at ZeRO-3, accelerate's default)" if flag is None else ""))


def _parallelism(imp: Import, size: dict) -> None:
    """accelerate 1.16 takes a ParallelismConfig beside DEEPSPEED for sequence parallelism:
    sp_size over DeepSpeed's Ulysses (sp_backend deepspeed, its only one), which is topology.cp on
    this backend (the same all-to-alls as DeepSpeed's ALST loop). Its other sizes are not
    DeepSpeed's dimensions: refused naming them (tensor parallelism is the DeepSpeed config's
    tensor_parallel.autotp_size)."""
    sp = imp.whole("parallelism_config.parallelism_config_sp_size", size.get("sp_size", 1) or 1)
    if sp is not None and sp > 1:
        imp.set("topology.cp", sp, "parallelism_config.parallelism_config_sp_size",
                detail=f"each row split over {sp} ranks by DeepSpeed's Ulysses all-to-all, as "
                "accelerate's sp_backend deepspeed")
    for key in ("sp_backend", "sp_seq_length", "sp_seq_length_is_variable",
                "sp_attn_implementation"):
        if key in size:
            imp.note(f"parallelism_config.parallelism_config_{key}", "ignored", "polyshard "
                     "splits each batch's rows as they come, with the model's own attention")
    other = {k: v for k, v in size.items() if k.endswith("_size") and k != "sp_size"
             and v not in (None, 1)}
    if other:
        imp.problems.append(("parallelism_config", f"{other}: beside DEEPSPEED accelerate runs "
                             "sp_size only (DeepSpeed's Ulysses); DeepSpeed's tensor parallelism "
                             "is its config's tensor_parallel.autotp_size"))


def _autotp_world(imp: Import) -> None:
    """accelerate 1.11 runs AutoTP over a 1-D mesh of the first autotp_size ranks
    (backends/deepspeed/files/exports.py: _accelerate_tp): with more processes the others fail."""
    tp = imp.spec.get("topology", {}).get("tp", 1)
    topology = {**imp.spec.get("topology", {}), **(imp.given_value("topology") or {})}
    world = topology.get("nodes", 1) * topology.get("procs_per_node", 1)
    if tp > 1 and world != tp:
        imp.problems.append(("deepspeed_config.deepspeed_config_file", f"tensor_parallel.autotp_size"
                             f" {tp} on {world} processes: accelerate 1.11 builds its TP mesh over "
                             f"the first {tp} ranks only and the others fail; it runs AutoTP with "
                             "autotp_size = num_processes (polyshard launch runs data parallelism "
                             "beside it: import the DeepSpeed file itself)"))


def _from_plugin(imp: Import, ds: dict) -> None:
    stage = ds.get("zero_stage", 2)
    if isinstance(stage, (list, dict, set)) or stage not in SHARD_OF_STAGE:  # unhashable: refused too
        imp.problems.append(("deepspeed_config.zero_stage", f"{stage!r} is no ZeRO stage; 0-3"))
        return
    imp.set("shard", SHARD_OF_STAGE[stage], "deepspeed_config.zero_stage",
            "mapped" if "zero_stage" in ds else "default",
            f"shard: {SHARD_OF_STAGE[stage]}" + ("" if "zero_stage" in ds else
                                                 " (absent: ZeRO-2, accelerate's default)"))
    optimizer = ds.get("offload_optimizer_device", "none") or "none"
    param = ds.get("offload_param_device", "none") or "none"
    zero = {"offload_optimizer": {"device": optimizer}, "offload_param": {"device": param}}
    for name, device in (("offload_optimizer", optimizer), ("offload_param", param)):
        path = ds.get(f"{name}_nvme_path")
        if device == "nvme" and path not in (None, "none"):
            zero[name]["nvme_path"] = path
    zero_section(imp, {"stage": stage, **zero})  # the zero_optimization the plugin builds
    _yaml_fields(imp, ds)
    if imp.spec.get("precision") == "fp16":  # Accelerator.set_mixed_precision's fp16 block
        imp.set("deepspeed.native.fp16", {"auto_cast": True}, "mixed_precision", "native",
                "accelerate's fp16 block casts floating inputs to fp16 (auto_cast: true)")
    imp.set("reduce_dtype", "compute", "deepspeed_config", "default",
            "DeepSpeed reduces in the compute dtype (accelerate sets no communication_data_type)")


def _yaml_fields(imp: Import, ds: dict) -> None:
    accum = ds.get("gradient_accumulation_steps", 1)
    accum = imp.whole("deepspeed_config.gradient_accumulation_steps", accum)
    if accum is not None:
        imp.set("grad_accum_steps", accum, "deepspeed_config.gradient_accumulation_steps",
                "mapped" if "gradient_accumulation_steps" in ds else "default")
    clip = ds.get("gradient_clipping")
    if clip is None:
        imp.set("grad_clip", 1.0, "deepspeed_config.gradient_clipping", "default",
                "absent: accelerate's Accelerator fills 1.0")
    elif isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip >= 0:
        imp.set("grad_clip", float(clip) if clip > 0 else None,
                "deepspeed_config.gradient_clipping")
    else:
        imp.problems.append(("deepspeed_config.gradient_clipping",
                             f"{str(clip)[:80]!r} is not a number >= 0"))
    if "zero3_save_16bit_model" in ds:  # absent: false, as zero_section already wrote
        imp.set("deepspeed.gather_16bit_weights_on_model_save", bool(ds["zero3_save_16bit_model"]),
                "deepspeed_config.zero3_save_16bit_model")


def _from_file(imp: Import, ds: dict, base) -> None:
    name = ds["deepspeed_config_file"]
    clash = [f"deepspeed_config.{k}" for k in sorted(ds) if k in
             PLUGIN_KEYS - {"deepspeed_config_file", "zero3_init_flag"}]
    clash += ["mixed_precision"] if "mixed_precision" in imp.sources.get("precision", "") and \
        imp.spec.get("precision") != "fp32" else []
    if clash:
        imp.problems += [(key, "is set beside deepspeed_config_file, which accelerate refuses (the "
                          "JSON decides; set it there, e.g. bf16.enabled): remove it")
                         for key in clash]
        return
    if base is None:
        imp.problems.append(("deepspeed_config.deepspeed_config_file", "cannot be read here"))
        return
    try:  # beside the yaml (accelerate opens it relative to the working directory)
        config = read_config(Path(base) / name)
    except (OSError, ValueError) as err:
        imp.problems.append(("deepspeed_config.deepspeed_config_file", f"{name!r}: {err}"))
        return
    inner = Import(imp.lossy, {**imp.given, "precision": imp.spec.get("precision")}, imp.validate)
    import_into(inner, config, caller="accelerate")  # "auto" precision: mixed_precision decides
    imp.problems += [(f"deepspeed_config_file: {p}", m) for p, m in inner.problems]
    imp.report += [(f"deepspeed_config_file: {f}", o, d) for f, o, d in inner.report]
    precision = imp.spec.get("precision")
    _deep_update(imp.spec, inner.spec)
    if inner.spec.get("precision") not in (None, precision) and precision != "fp32":
        imp.problems.append(("mixed_precision", f"{precision!r} contradicts the DeepSpeed file's "
                             f"{inner.spec['precision']!r}; accelerate refuses the pair"))
    elif inner.spec.get("precision") is None:
        imp.spec["precision"] = precision  # the file's "auto": accelerate's mixed_precision


def _deep_update(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_update(into[key], value)
        else:
            into[key] = value
