"""transformers' `DistributedConfig` (what from_pretrained takes, and what its `to_json_file`
writes) as a spec: transformers' native FSDP2 with its own dimensions, read after its class resolved
them (`__post_init__`: the defaults, the legacy `enable_expert_parallel`), so the sizes are what
transformers itself runs. What polyshard cannot keep is a problem naming the field, as for files
(exit 2 at the CLI). accelerate's `ParallelismConfig` object is read by the accelerate file reader
(accelerate.py's from_parallelism_config). A kit: the caller passes the spec validation."""

from __future__ import annotations

from collections.abc import Callable

from parallel.interop.importing import Import, Report

DISTRIBUTED_REFUSED = {
    "fsdp_plan": "polyshard picks FSDP units by wrap.policy (e.g. layer_classes)",
    "ep_plan": "topology.ep splits each block's experts itself (docs/moe.md)",
    "enable_sequence_parallel": "transformers reserves it (not wired); topology.cp splits rows",
    "fsdp_mixed_precision": "polyshard's precision field names the dtype: set precision: bf16",
}


def from_distributed_config(config, validate: Callable[[dict], object], lossy: bool = False,
                            given: dict | None = None) -> tuple[dict, Report]:
    """transformers' DistributedConfig (or its JSON as a dict, read by transformers' own
    `from_dict`): tp_size, fsdp_size, dp_replicate_size, pp_size, ep_size as topology and
    sharding on FSDP2; (spec dict, report). `validate`: the spec validation (load_spec)."""
    if isinstance(config, dict):
        from transformers.distributed import DistributedConfig

        unknown = sorted(set(config) - set(DistributedConfig.__dataclass_fields__))
        if unknown:
            imp = Import(lossy, given or {}, validate)
            imp.problems += [(k, "transformers' DistributedConfig has no such field") for k in unknown]
            return imp.finish()
        config = DistributedConfig.from_dict(config)
    d = config.to_dict()
    imp = Import(lossy, given or {}, validate)
    imp.set("backend", "fsdp", "DistributedConfig", detail="transformers' native FSDP2")
    imp.set("fsdp.version", 2, "DistributedConfig")
    imp.set("wrap.policy", "auto", "fsdp_plan", "default", "wrap.policy: auto (transformers' "
            "default FSDP plan: each decoder layer a unit, the model's _no_split_modules)")
    for key, path in (("tp_size", "topology.tp"), ("pp_size", "topology.pp"),
                      ("ep_size", "topology.ep")):
        if (d.get(key) or 1) > 1:
            imp.set(path, d[key], key)
    if isinstance(d.get("tp_plan"), dict) and d["tp_plan"]:
        imp.set("topology.tp_plan", d["tp_plan"], "tp_plan")
    elif d.get("tp_plan") == {} and (d.get("tp_size") or 1) > 1:  # legacy enable_expert_parallel
        imp.refuse("tp_plan", f"{{}} with tp_size {d['tp_size']}: the tp ranks share a batch and "
                   "hold whole dense modules (experts split over them); polyshard's topology.ep "
                   "splits experts over data-parallel ranks: use fsdp_size for them and ep_size")
    if (d.get("dp_replicate_size") or 1) > 1:
        imp.set("shard", "hybrid", "dp_replicate_size", detail=f"{d['dp_replicate_size']} "
                "replicas of FSDP groups: hybrid sharding")
        imp.set("topology.shard_group_size", d.get("fsdp_size") or 1, "fsdp_size")
    if d.get("fsdp_cpu_offload"):
        imp.set("offload", "params", "fsdp_cpu_offload")
    for key, why in DISTRIBUTED_REFUSED.items():
        if d.get(key):
            imp.refuse(key, f"{d[key]!r}: {why}")
    if d.get("ep_implementation", "auto") not in ("auto", "all_to_all"):
        imp.refuse("ep_implementation", f"{d['ep_implementation']!r}: topology.ep exchanges "
                   "tokens by all-to-all")
    return imp.finish()
