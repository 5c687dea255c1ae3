"""torch FSDP specs as accelerate and HF Trainer files (parallel/interop/export.py dispatches here)."""

from __future__ import annotations

from parallel.interop.export import (
    PREFETCH_OF,
    STRATEGY_OF,
    accelerate_wrap,
    common_accelerate,
    fsdp_words,
    trainer_args,
    trainer_document,
    trainer_layers,
)
from parallel.spec.model import Spec


def to_accelerate(spec: Spec) -> dict:
    if spec.shard == "none":  # replicate everything, all-reduce gradients: accelerate's DDP
        kind = "MULTI_GPU" if spec.world_size > 1 else "NO"
        return {**common_accelerate(spec), "distributed_type": kind}
    f = spec.fsdp
    fsdp = {"fsdp_version": f.version, "fsdp_offload_params": spec.offload == "params", **accelerate_wrap(spec),
            "fsdp_state_dict_type": "FULL_STATE_DICT" if spec.state_dict == "full"
            else "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": f.cpu_ram_efficient_loading,
            "fsdp_activation_checkpointing": spec.activation_checkpointing}
    if f.version == 1:
        fsdp.update(fsdp_sharding_strategy=STRATEGY_OF[spec.shard],
                    fsdp_backward_prefetch=PREFETCH_OF[f.backward_prefetch],
                    fsdp_forward_prefetch=f.forward_prefetch, fsdp_use_orig_params=f.use_orig_params,
                    fsdp_sync_module_states=f.sync_module_states)
        return {**common_accelerate(spec), "distributed_type": "FSDP", "fsdp_config": fsdp}
    # FSDP2 reads the resharding choice, and replicates across groups through parallelism_config
    fsdp["fsdp_reshard_after_forward"] = spec.shard in ("full", "hybrid")
    out = {**common_accelerate(spec), "distributed_type": "FSDP", "fsdp_config": fsdp}
    if spec.shard in ("hybrid", "hybrid_grad_op"):
        group = spec.shard_group_size
        out["parallelism_config"] = {"parallelism_config_dp_replicate_size": spec.world_size // group,
                                     "parallelism_config_dp_shard_size": group}
    return out


def to_hf_trainer(spec: Spec) -> dict:
    config = {"backward_prefetch": spec.fsdp.backward_prefetch.replace("none", "no_prefetch"),
              "forward_prefetch": spec.fsdp.forward_prefetch,
              "use_orig_params": spec.fsdp.use_orig_params,
              "sync_module_states": spec.fsdp.sync_module_states,
              "cpu_ram_efficient_loading": spec.fsdp.cpu_ram_efficient_loading,
              "activation_checkpointing": spec.activation_checkpointing, **trainer_layers(spec)}
    # TrainingArguments passes the FSDP options to accelerate as FSDP_* variables but not the version,
    # which accelerate's plugin reads from FSDP_VERSION (default 1): written here either way, so an
    # FSDP2 spec never runs FSDP1 and a stray FSDP_VERSION=2 never turns an FSDP1 spec into FSDP2
    return trainer_document({**trainer_args(spec), "fsdp": fsdp_words(spec), "fsdp_config": config},
                            {"FSDP_VERSION": str(spec.fsdp.version)})
