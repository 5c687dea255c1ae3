"""torch FSDP specs as accelerate and HF Trainer files (parallel/interop/export.py dispatches here)."""

from __future__ import annotations

from parallel.interop.exporting import (
    PREFETCH_OF,
    STRATEGY_OF,
    accelerate_wrap,
    common_accelerate,
    trainer_args,
    trainer_document,
    trainer_layers,
    trainer_sharding,
)
from parallel.spec.errors import SpecError
from parallel.spec.model import Spec


def _tensor_parallel(spec: Spec, tool: str) -> None:
    """accelerate runs `topology.tp` as its ParallelismConfig's tp_size over FSDP2, splitting by the
    model's own plan (transformers' tp_plan); what it cannot carry is refused, naming the field."""
    problems = []
    if spec.topology.tp_plan is not None:
        problems.append(("topology.tp_plan", f"{tool} splits by the model's own tp plan; remove "
                         "tp_plan (or set the model's base_model_tp_plan) to export"))
    if spec.shard == "none":
        problems.append(("shard", f"'none' with topology.tp {spec.topology.tp}: {tool} runs tensor "
                         "parallelism through FSDP2 only; use shard: full or grad_op"))
    if problems:
        raise SpecError(problems)


def to_accelerate(spec: Spec) -> dict:
    if spec.topology.tp > 1:
        _tensor_parallel(spec, "accelerate")
    if spec.shard == "none":  # replicate everything, all-reduce gradients: accelerate's DDP
        kind = "MULTI_GPU" if spec.world_size > 1 else "NO"
        return {**common_accelerate(spec), "distributed_type": kind}
    f = spec.fsdp
    fsdp = {"fsdp_version": f.version, "fsdp_offload_params": spec.offload == "params",
            **accelerate_wrap(spec),
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
    dims = spec.dims
    if spec.shard in ("hybrid", "hybrid_grad_op"):
        out["parallelism_config"] = {"parallelism_config_dp_replicate_size": dims.dp_replicate,
                                     "parallelism_config_dp_shard_size": dims.dp_shard}
    if dims.tp > 1:  # accelerate's mesh is (dp_replicate, dp_shard, cp, tp): tp innermost, as ours
        out.setdefault("parallelism_config", {}).update(
            parallelism_config_dp_shard_size=dims.dp_shard, parallelism_config_tp_size=dims.tp)
    if dims.cp > 1:  # accelerate runs torch's ring attention where polyshard runs Ulysses: the
        # same split of each row and the same loss (docs/long-sequences.md)
        out.setdefault("parallelism_config", {}).update(
            parallelism_config_dp_shard_size=dims.dp_shard, parallelism_config_cp_size=dims.cp)
    return out


def to_hf_trainer(spec: Spec) -> dict:
    for dim, what in (("tp", "tensor"), ("cp", "context")):
        degree = getattr(spec.topology, dim)
        if degree > 1:
            raise SpecError([(f"topology.{dim}", f"{degree}: TrainingArguments takes {what} "
                              "parallelism as a ParallelismConfig object, which no file carries; "
                              "export --to accelerate (parallelism_config) and run the Trainer "
                              "under accelerate launch with it")])
    config = {"backward_prefetch": spec.fsdp.backward_prefetch.replace("none", "no_prefetch"),
              "forward_prefetch": spec.fsdp.forward_prefetch,
              "use_orig_params": spec.fsdp.use_orig_params,
              "sync_module_states": spec.fsdp.sync_module_states,
              "cpu_ram_efficient_loading": spec.fsdp.cpu_ram_efficient_loading,
              "activation_checkpointing": spec.activation_checkpointing, **trainer_layers(spec)}
    # the version written either way (fsdp_config's default is 2): an FSDP1 spec never runs FSDP2
    return trainer_document({**trainer_args(spec), "fsdp": True,
                             "fsdp_config": {**trainer_sharding(spec, spec.fsdp.version), **config}})
