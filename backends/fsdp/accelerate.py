"""An accelerate YAML's `fsdp_config` as a spec, meaning what accelerate 1.11's launcher and
FullyShardedDataParallelPlugin make of it (measured in tests/unit/test_real_configs.py):

- a key the file leaves out takes `accelerate launch`'s default: fsdp_version 1, FULL_SHARD (v1) /
  reshard after forward (v2), no auto wrap, no offload, FSDP1 without backward prefetch,
  cpu_ram_efficient_loading on, sync_module_states on (v1), state dict FULL (v1) / SHARDED (v2);
- TRANSFORMER_BASED_WRAP without a class list means the model's `_no_split_modules` (wrap.policy:
  auto); SIZE_BASED_WRAP without fsdp_min_num_params means 1e8;
- FSDP1 reads fsdp_sharding_strategy, not fsdp_reshard_after_forward; FSDP2 the reverse, and no
  backward prefetch, use_orig_params or sync_module_states (it broadcasts rank 0's weights exactly when
  cpu_ram_efficient_loading is on); the key of the other version is reported as ignored;
- `fsdp_backward_prefetch_policy` (an older name) is not read by accelerate 1.11: reported, and the
  file means no backward prefetch, as under accelerate.
"""

from __future__ import annotations

import difflib

from parallel.interop.importing import (BY_NUMBER, PREFETCH, STRATEGIES, Import, parallelism_sizes,
                                       strategy, wrap_section)

STRATEGY_NAMES = {v: k for k, v in STRATEGIES.items()}

KEYS = {"fsdp_version", "fsdp_sharding_strategy", "fsdp_reshard_after_forward", "fsdp_offload_params",
        "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params",
        "fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_state_dict_type",
        "fsdp_use_orig_params", "fsdp_sync_module_states", "fsdp_cpu_ram_efficient_loading",
        "fsdp_activation_checkpointing", "fsdp_ignored_modules"}
XLA_KEYS = {"xla", "xla_fsdp_settings", "xla_fsdp_grad_ckpt", "xla_fsdp_v2"}


def _bool(value) -> bool:
    return str(value).lower() in ("true", "1", "yes")


DATA_PARALLEL = {"MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA",
                 "MULTI_HPU", "MULTI_SDAA", "NO"}


def claims(kind: str, cfg: dict) -> int:
    """FSDP files and accelerate's data-parallel types (a backend that reads an FSDP file more
    specifically, as XLA FSDP one with transformers' xla key, claims higher)."""
    return 1 if kind == "FSDP" or kind in DATA_PARALLEL else 0


def section(imp: Import, cfg: dict, base) -> None:
    kind = str(cfg.get("distributed_type", "NO")).upper()
    if kind in DATA_PARALLEL:
        imp.set("backend", "fsdp", "distributed_type", detail=f"{kind}: data parallel = backend "
                "fsdp, shard: none (gradients all-reduced, nothing sharded)")
        imp.set("shard", "none", "distributed_type")
        return
    fsdp_section(imp, dict(cfg.get("fsdp_config") or {}))
    _parallelism(imp, cfg.get("parallelism_config") or {})


def fsdp_section(imp: Import, fsdp: dict) -> None:
    imp.set("backend", "fsdp", "distributed_type")
    _unknown_keys(imp, fsdp)
    version = imp.whole("fsdp_config.fsdp_version", fsdp.get("fsdp_version", 1))
    if version is None:
        return
    if version not in (1, 2):
        imp.problems.append(("fsdp_config.fsdp_version", f"{version!r}: accelerate runs FSDP 1 or 2"))
        return
    imp.set("fsdp.version", version, "fsdp_config.fsdp_version",
            "mapped" if "fsdp_version" in fsdp else "default",
            f"fsdp.version: {version}" + ("" if "fsdp_version" in fsdp else " (absent: accelerate's "
                                          "default 1)"))
    (_v2 if version == 2 else _v1)(imp, fsdp)
    wrap_section(imp, fsdp)
    offload = _bool(fsdp.get("fsdp_offload_params", False))
    imp.set("offload", "params" if offload else "none", "fsdp_config.fsdp_offload_params",
            "mapped" if "fsdp_offload_params" in fsdp else "default")
    kind = str(fsdp.get("fsdp_state_dict_type", "SHARDED_STATE_DICT" if version == 2
                        else "FULL_STATE_DICT")).upper()
    if kind not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        imp.problems.append(("fsdp_config.fsdp_state_dict_type", f"{kind!r}: polyshard writes "
                             "FULL_STATE_DICT or SHARDED_STATE_DICT checkpoints"))
    else:
        imp.set("state_dict", "full" if kind == "FULL_STATE_DICT" else "sharded",
                "fsdp_config.fsdp_state_dict_type",
                "mapped" if "fsdp_state_dict_type" in fsdp else "default")
    lazy = _bool(fsdp.get("fsdp_cpu_ram_efficient_loading", True))
    imp.set("fsdp.cpu_ram_efficient_loading", lazy, "fsdp_config.fsdp_cpu_ram_efficient_loading",
            "mapped" if "fsdp_cpu_ram_efficient_loading" in fsdp else "default",
            f"fsdp.cpu_ram_efficient_loading: {lazy}" + (
                "" if "fsdp_cpu_ram_efficient_loading" in fsdp else " (absent: on, accelerate "
                "launch's default; prepare() then needs a model factory)"))
    if version == 2:  # FSDP2 broadcasts rank 0's weights exactly when loading lazily
        imp.set("fsdp.sync_module_states", lazy, "fsdp_config.fsdp_cpu_ram_efficient_loading",
                "mapped", "FSDP2 under accelerate broadcasts rank 0's weights only with it")
    checkpointing = _bool(fsdp.get("fsdp_activation_checkpointing", False))
    imp.set("activation_checkpointing", checkpointing, "fsdp_config.fsdp_activation_checkpointing",
            "mapped" if "fsdp_activation_checkpointing" in fsdp else "default")
    if fsdp.get("fsdp_ignored_modules") is not None:
        imp.refuse("fsdp_config.fsdp_ignored_modules", "modules FSDP leaves unsharded have no "
                   "polyshard field; remove it")
    elif "fsdp_ignored_modules" in fsdp:
        imp.note("fsdp_config.fsdp_ignored_modules", "mapped", "null: no module is ignored")


def _unknown_keys(imp: Import, fsdp: dict) -> None:
    for key in fsdp:
        if key in KEYS or key in XLA_KEYS:
            continue
        if key == "fsdp_backward_prefetch_policy":
            imp.note("fsdp_config.fsdp_backward_prefetch_policy", "ignored", "accelerate 1.11 does "
                     "not read this older name (it reads fsdp_backward_prefetch): the file runs "
                     "without backward prefetch, and so does the spec; rename the key to prefetch")
            continue
        hint = difflib.get_close_matches(key, sorted(KEYS), n=1, cutoff=0.75)
        if hint:
            imp.problems.append((f"fsdp_config.{key}", f"accelerate does not read it; did you mean "
                                 f"{hint[0]!r}?"))
        else:
            imp.note(f"fsdp_config.{key}", "ignored", "accelerate does not read it")


def _v1(imp: Import, fsdp: dict) -> None:
    shard = strategy(imp, fsdp.get("fsdp_sharding_strategy", "FULL_SHARD"),
                      "fsdp_config.fsdp_sharding_strategy")
    if shard:
        imp.set("shard", shard, "fsdp_config.fsdp_sharding_strategy",
                "mapped" if "fsdp_sharding_strategy" in fsdp else "default")
    asked = str(fsdp.get("fsdp_reshard_after_forward", "")).upper()
    asked = BY_NUMBER.get(asked, asked)
    if asked in STRATEGIES and STRATEGIES[asked] != shard:
        # `accelerate config` writes its FSDP1 sharding question here, but `accelerate launch`
        # always exports FSDP_SHARDING_STRATEGY (default FULL_SHARD), which accelerate's plugin
        # prefers: the answer is silently dropped (measured with its launcher and plugin)
        imp.refuse("fsdp_config.fsdp_reshard_after_forward", f"{asked} is what `accelerate "
                   f"config` records as FSDP1's sharding strategy, but accelerate 1.11's launcher "
                   f"passes fsdp_sharding_strategy ({STRATEGY_NAMES[shard]}) instead and its plugin "
                   f"prefers that, so the file runs {STRATEGY_NAMES[shard]}, not {asked}. Add "
                   f"fsdp_sharding_strategy: {asked} to run what you asked (under accelerate too)")
    elif "fsdp_reshard_after_forward" in fsdp:
        imp.note("fsdp_config.fsdp_reshard_after_forward", "ignored", "FSDP1 under accelerate reads "
                 "fsdp_sharding_strategy only")
    prefetch = str(fsdp.get("fsdp_backward_prefetch", "NO_PREFETCH")).upper()
    if prefetch not in PREFETCH:
        imp.problems.append(("fsdp_config.fsdp_backward_prefetch", f"{prefetch!r}: one of "
                             f"{', '.join(PREFETCH)}"))
    else:
        imp.set("fsdp.backward_prefetch", PREFETCH[prefetch], "fsdp_config.fsdp_backward_prefetch",
                "mapped" if "fsdp_backward_prefetch" in fsdp else "default",
                f"fsdp.backward_prefetch: {PREFETCH[prefetch]}" + (
                    "" if "fsdp_backward_prefetch" in fsdp else " (absent: accelerate passes none)"))
    for key, field, default in (("fsdp_forward_prefetch", "forward_prefetch", False),
                                ("fsdp_use_orig_params", "use_orig_params", True),
                                ("fsdp_sync_module_states", "sync_module_states", True)):
        imp.set(f"fsdp.{field}", _bool(fsdp.get(key, default)), f"fsdp_config.{key}",
                "mapped" if key in fsdp else "default")


def _v2(imp: Import, fsdp: dict) -> None:
    reshard = _bool(fsdp.get("fsdp_reshard_after_forward", True))
    imp.set("shard", "full" if reshard else "grad_op", "fsdp_config.fsdp_reshard_after_forward",
            "mapped" if "fsdp_reshard_after_forward" in fsdp else "default",
            f"shard: {'full' if reshard else 'grad_op'} (reshard after forward: {reshard})")
    for key, why in (("fsdp_sharding_strategy", "FSDP2 reads fsdp_reshard_after_forward"),
                     ("fsdp_backward_prefetch", "FSDP2 always prefetches (accelerate sets none)"),
                     ("fsdp_forward_prefetch", "accelerate's FSDP2 does not forward-prefetch"),
                     ("fsdp_use_orig_params", "FSDP2 always keeps original parameters"),
                     ("fsdp_sync_module_states", "FSDP2 under accelerate broadcasts with "
                      "cpu_ram_efficient_loading only")):
        if key in fsdp:
            imp.note(f"fsdp_config.{key}", "ignored", why)


def _parallelism(imp: Import, par: dict) -> None:
    """accelerate's ND parallelism (FSDP2): replicas x shard groups is hybrid sharding; its tp_size
    is topology.tp (the model's own tp plan, TP innermost, as accelerate's mesh has it); its cp_size
    is topology.cp (the same mesh place, inside tp's; accelerate splits each row over the group and
    runs torch's ring attention, polyshard runs Ulysses: the same loss)."""
    size = parallelism_sizes(imp, par)
    sp = imp.whole("parallelism_config.parallelism_config_sp_size", size.get("sp_size", 1) or 1)
    if sp is not None and sp > 1:
        imp.problems.append(("parallelism_config.parallelism_config_sp_size", f"{sp}: accelerate "
                             "runs sp_size as DeepSpeed's Ulysses (sp_backend: deepspeed, "
                             "distributed_type DEEPSPEED); under FSDP split rows with "
                             "parallelism_config_cp_size (topology.cp)"))
    for key in ("cp_backend", "cp_comm_strategy"):
        if key in size:
            imp.note(f"parallelism_config.parallelism_config_{key}", "ignored", "polyshard's "
                     "topology.cp exchanges by Ulysses all-to-all: the same loss")
    cp = int(size.get("cp_size", 1) or 1)
    if cp > 1:
        imp.set("topology.cp", cp, "parallelism_config.parallelism_config_cp_size",
                detail=f"each row split over {cp} ranks (accelerate: torch's ring attention; "
                "polyshard: Ulysses all-to-all, the same loss)")
    tp = int(size.get("tp_size", 1) or 1)
    if tp > 1:
        imp.set("topology.tp", tp, "parallelism_config.parallelism_config_tp_size",
                detail="split by the model's own tp plan, as accelerate's transformers tp_plan")
    replicas = int(size.get("dp_replicate_size", 1) or 1)
    if replicas > 1:
        shard = imp.spec.get("shard")
        imp.set("shard", "hybrid" if shard in ("full", "hybrid") else "hybrid_grad_op",
                "parallelism_config.parallelism_config_dp_replicate_size",
                detail=f"{replicas} replicas of shard groups: hybrid sharding")
        imp.set("topology.shard_group_size", int(size.get("dp_shard_size", 1) or 1),
                "parallelism_config.parallelism_config_dp_shard_size")
