"""An accelerate YAML's `fsdp_config` XLA keys as a spec. These are transformers' keys (Trainer's
`fsdp_config`: `xla`, `xla_fsdp_v2`, `xla_fsdp_grad_ckpt`, `xla_fsdp_settings`), which Hugging Face's
FSDP guide puts in the accelerate file; accelerate itself does not read them. They select XLA FSDP
(v1, or SPMD v2), activation checkpointing of each wrapped unit, and XlaFullyShardedDataParallel's
own arguments; the sharding strategy and wrap policy keep their accelerate meaning."""

from __future__ import annotations

from parallel.interop.importing import Import, strategy, wrap_section

READ = {"xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings", "fsdp_sharding_strategy",
        "fsdp_auto_wrap_policy", "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params"}


def xla_requested(cfg: dict) -> bool:
    """The `xla` key transformers' guide adds to an accelerate file (top level or in fsdp_config)."""
    return bool((cfg.get("fsdp_config") or {}).get("xla") or cfg.get("xla"))


def claims(kind: str, cfg: dict) -> int:
    return 2 if kind == "XLA" or (kind == "FSDP" and xla_requested(cfg)) else 0


def section(imp: Import, cfg: dict, base) -> None:
    fsdp = {**(cfg.get("fsdp_config") or {}), **({"xla": cfg["xla"]} if "xla" in cfg else {})}
    xla_section(imp, fsdp, str(cfg.get("distributed_type")).upper())


def xla_section(imp: Import, fsdp: dict, kind: str) -> None:
    imp.set("backend", "xla_fsdp", "fsdp_config.xla" if fsdp.get("xla") else "distributed_type")
    if not fsdp.get("xla"):
        imp.problems.append(("distributed_type", f"{kind}: TPU data parallel without FSDP has no "
                             "polyshard equivalent; add fsdp_config with xla: true for XLA FSDP"))
        return
    v2 = bool(fsdp.get("xla_fsdp_v2", False))
    imp.set("xla.fsdp_version", 2 if v2 else 1, "fsdp_config.xla_fsdp_v2",
            "mapped" if "xla_fsdp_v2" in fsdp else "default")
    shard = strategy(imp, fsdp.get("fsdp_sharding_strategy", "FULL_SHARD"),
                     "fsdp_config.fsdp_sharding_strategy")
    if shard:
        imp.set("shard", shard, "fsdp_config.fsdp_sharding_strategy",
                "mapped" if "fsdp_sharding_strategy" in fsdp else "default")
    wrap_section(imp, fsdp)
    if "xla_fsdp_grad_ckpt" in fsdp:
        imp.set("xla.xla_fsdp_grad_ckpt", bool(fsdp["xla_fsdp_grad_ckpt"]),
                "fsdp_config.xla_fsdp_grad_ckpt")
    settings = dict(fsdp.get("xla_fsdp_settings") or {})
    if settings:
        imp.set("xla.xla_fsdp_settings", settings, "fsdp_config.xla_fsdp_settings")
    for key in sorted(set(fsdp) - READ):
        imp.note(f"fsdp_config.{key}", "ignored", "not read on XLA FSDP")
