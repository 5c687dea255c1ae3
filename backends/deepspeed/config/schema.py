"""What DeepSpeed 0.19.8 reads from a config, as data (no deepspeed import).

`polyshard import deepspeed` and the adapter's `native:` merge use these tables to refuse what DeepSpeed
refuses (unknown zero_optimization keys, a field given under two names) and to say what DeepSpeed does
with what it does not refuse (unknown top-level keys are silently ignored). tests/unit/
test_deepspeed_schema.py checks every table against the installed DeepSpeed's own parser, so an upgrade
that adds or renames a key fails a test instead of drifting.
"""

from __future__ import annotations

import difflib

# Top-level keys DeepSpeedConfig looks at (recorded from its parser: every key it gets, tests with `in`,
# or reads), plus the one its constructor reads before parsing. Any other key has no effect.
TOP_LEVEL = frozenset({
    "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "bfloat16", "checkpoint", "comet",
    "comms_logger", "communication_data_type", "compile", "compression_training", "csv_monitor",
    "curriculum_learning", "data_efficiency", "data_types", "dataloader_drop_last", "datastates_ckpt",
    "disable_allgather", "disable_python_gc", "dump_state", "eigenvalue", "elasticity",
    "expert_parallel", "flops_profiler", "fp16", "gradient_accumulation_steps",
    "gradient_allreduce_op", "gradient_clipping", "gradient_predivide_factor", "graph_harvesting",
    "hybrid_engine", "log_level", "managed_gradient_accumulation", "memory_breakdown", "nebula",
    "optimizer", "pipeline", "prescale_gradients", "progressive_layer_drop", "quantize_training",
    "scheduler", "seq_parallel_communication_data_type", "sparse_attention", "sparse_gradients",
    "steps_per_print", "tensor_parallel", "tensorboard", "timers", "torch_autocast", "train_batch_size",
    "train_micro_batch_size_per_gpu", "use_data_before_expert_parallelism", "vocabulary_size",
    "wall_clock_breakdown", "wandb", "weight_quantization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "zero_optimization", "sequence_parallel_size",
})

# zero_optimization: JSON key -> field. DeepSpeed accepts a field under its name or its alias (the
# `stage3_` form); giving both is refused. Written back under the JSON key listed here (the alias
# where there is one, the name DeepSpeed documents).
ZERO_ALIASES = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential": "allgather_sequential",
}
ZERO_FIELDS = frozenset({
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size", "overlap_comm",
    "compute_grad_norm", "load_from_fp32_weights", "elastic_checkpoint", "offload_param",
    "offload_optimizer", "zenflow", "sub_group_size", "ignore_unused_parameters", "legacy_stage1",
    "round_robin_gradients", "parameter_alignment", "zero_hpz_partition_size",
    "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
    "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
    "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory",
    "leaf_module", *ZERO_ALIASES.values(),
})
# Deprecated names DeepSpeed still accepts (with a warning) and what they became.
ZERO_DEPRECATED = {"stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save",
                   "cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param",
                   "cpu_offload_use_pin_memory": "pin_memory"}
OFFLOAD_FIELDS = {
    "offload_optimizer": frozenset({"device", "nvme_path", "buffer_count", "pin_memory",
                                    "pipeline_read", "pipeline_write", "fast_init", "ratio",
                                    "super_offload", "cpuadam_cores_perc"}),
    "offload_param": frozenset({"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu",
                                "pin_memory"}),
}
FP16_FIELDS = frozenset({"enabled", "auto_cast", "loss_scale", "initial_scale_power",
                         "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                         "min_loss_scale", "fp16_master_weights_and_grads"})
BF16_FIELDS = frozenset({"enabled", "immediate_grad_update", "check_grad_overflow",
                         "bf16_master_weights_and_grads", "bf16_optimizer_states"})

# Defaults that differ from polyshard's, applied explicitly when a file leaves the key out.
DEFAULTS = {"gradient_clipping": 1.0, "pin_memory": True, "gather_16bit_weights_on_model_save": False,
            "communication_data_type": None}  # None: the compute dtype (engine.communication_data_type)


def field_of(key: str) -> str:
    """A zero_optimization key's field (its alias resolved)."""
    return ZERO_ALIASES.get(key, key)


def json_key(field: str) -> str:
    """The JSON key a zero_optimization field is written under."""
    return next((alias for alias, name in ZERO_ALIASES.items() if name == field), field)


def closest(word: str, known) -> str | None:
    found = difflib.get_close_matches(word, sorted(known), n=1, cutoff=0.75)
    return found[0] if found else None


def zero_key_problems(zero: dict, where: str) -> list[tuple[str, str]]:
    """Keys of a zero_optimization block DeepSpeed refuses: unknown ones, and one field under two
    names (DeepSpeed's pydantic model forbids both; measured with DeepSpeedConfig)."""
    problems, seen = [], {}
    known = ZERO_FIELDS | set(ZERO_ALIASES) | set(ZERO_DEPRECATED)
    for key, value in zero.items():
        if key not in known:
            hint = closest(key, known)
            problems.append((f"{where}.{key}", "is no zero_optimization setting of DeepSpeed 0.19.8 "
                             "(its own parser refuses it)" + (f"; did you mean {hint!r}?" if hint
                                                               else "")))
            continue
        field = ZERO_DEPRECATED.get(key, field_of(key))
        if field in seen:
            problems.append((f"{where}.{key}", f"sets {field} already set by {seen[field]!r}; "
                             "DeepSpeed refuses one setting under two names: keep one"))
        seen[field] = key
        if key in OFFLOAD_FIELDS and isinstance(value, dict):
            for sub in value:
                if sub not in OFFLOAD_FIELDS[key]:
                    hint = closest(sub, OFFLOAD_FIELDS[key])
                    problems.append((f"{where}.{key}.{sub}", "is no DeepSpeed offload setting"
                                     + (f"; did you mean {hint!r}?" if hint else "")))
    return problems
