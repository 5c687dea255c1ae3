"""A spec as the files other tools take: an accelerate config (what `accelerate launch` reads), a
DeepSpeed JSON (what `deepspeed.initialize` takes, from the DeepSpeed adapter's own translation), and
HF `TrainingArguments` keyword arguments (`fsdp`, `fsdp_config` with the XLA keys, `deepspeed`).

Accelerate exports mean what the spec means under accelerate 1.11's launcher (checked by importing them
back and by accelerate's own plugin classes in tests/unit/test_real_configs.py): every key is written,
none is left to a default, FSDP2 under FSDP2's names (fsdp_reshard_after_forward, no sharding strategy),
a DeepSpeed spec as `deepspeed_config_file` pointing at the full DeepSpeed JSON written beside it."""

from __future__ import annotations

import json

from parallel.interop.accelerate import PREFETCH, STRATEGIES
from parallel.registry import explain
from parallel.spec.model import Spec
from parallel.spec.io import SpecError, load_spec

STRATEGY_OF = {v: k for k, v in STRATEGIES.items()}
PREFETCH_OF = {v: k for k, v in PREFETCH.items()}
MIXED = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def _wrap(spec: Spec) -> dict:
    policy = spec.wrap.policy
    if policy == "size":
        return {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": spec.wrap.min_num_params}
    if policy == "none":
        return {"fsdp_auto_wrap_policy": "NO_WRAP"}
    wrap = {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    if spec.wrap.layer_classes:  # `auto` lets accelerate read _no_split_modules, as polyshard does
        wrap["fsdp_transformer_layer_cls_to_wrap"] = ",".join(spec.wrap.layer_classes)
    return wrap


def _common_accelerate(spec: Spec) -> dict:
    nodes = spec.topology.nodes
    common = {"compute_environment": "LOCAL_MACHINE", "debug": False, "machine_rank": 0,
              "main_training_function": "main", "mixed_precision": MIXED[spec.precision],
              "num_machines": nodes, "num_processes": spec.world_size,
              "rdzv_backend": "c10d" if nodes > 1 else "static", "same_network": nodes == 1,
              "use_cpu": False}
    if spec.topology.rdzv_endpoint:
        host, _, port = spec.topology.rdzv_endpoint.rpartition(":")
        common.update(main_process_ip=host, main_process_port=int(port))
    return common


def _accelerate_deepspeed(spec: Spec) -> dict:
    config = explain(spec)["config"]
    name = "deepspeed_config.json"
    common = _common_accelerate(spec)
    del common["mixed_precision"]  # beside deepspeed_config_file accelerate refuses it: the JSON says
    return {**common, "distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_config_file": name, "zero3_init_flag": spec.deepspeed.zero_init,
        "deepspeed_multinode_launcher": "standard"},
        "__files__": {name: json.dumps(config, indent=2) + "\n"}}


def _accelerate_fsdp(spec: Spec) -> dict:
    if spec.shard == "none":  # replicate everything, all-reduce gradients: accelerate's DDP
        kind = "MULTI_GPU" if spec.world_size > 1 else "NO"
        return {**_common_accelerate(spec), "distributed_type": kind}
    f = spec.fsdp
    fsdp = {"fsdp_version": f.version, "fsdp_offload_params": spec.offload == "params", **_wrap(spec),
            "fsdp_state_dict_type": "FULL_STATE_DICT" if spec.state_dict == "full"
            else "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": f.cpu_ram_efficient_loading,
            "fsdp_activation_checkpointing": spec.activation_checkpointing}
    if f.version == 1:
        fsdp.update(fsdp_sharding_strategy=STRATEGY_OF[spec.shard],
                    fsdp_backward_prefetch=PREFETCH_OF[f.backward_prefetch],
                    fsdp_forward_prefetch=f.forward_prefetch, fsdp_use_orig_params=f.use_orig_params,
                    fsdp_sync_module_states=f.sync_module_states)
        return {**_common_accelerate(spec), "distributed_type": "FSDP", "fsdp_config": fsdp}
    # FSDP2 reads the resharding choice, and replicates across groups through parallelism_config
    fsdp["fsdp_reshard_after_forward"] = spec.shard in ("full", "hybrid")
    out = {**_common_accelerate(spec), "distributed_type": "FSDP", "fsdp_config": fsdp}
    if spec.shard in ("hybrid", "hybrid_grad_op"):
        group = spec.shard_group_size
        out["parallelism_config"] = {"parallelism_config_dp_replicate_size": spec.world_size // group,
                                     "parallelism_config_dp_shard_size": group}
    return out


ACCELERATE = {"fsdp": _accelerate_fsdp, "deepspeed": _accelerate_deepspeed}  # no XLA FSDP there


def to_accelerate(spec: Spec) -> dict:
    export = ACCELERATE.get(spec.backend)
    if export is None:
        raise SpecError([("backend", f"{spec.backend!r}: accelerate has no XLA FSDP; export it "
                          "with --to hf-trainer (TrainingArguments' fsdp_config.xla)")])
    return export(spec)


def to_deepspeed(spec: Spec) -> dict:
    data = spec.model_dump(mode="json", exclude_unset=True)
    return explain(load_spec({**data, "backend": "deepspeed"}))["config"]


def _trainer_args(spec: Spec) -> dict:
    return {"per_device_train_batch_size": spec.micro_batch_size,
            "gradient_accumulation_steps": spec.grad_accum_steps,
            "max_grad_norm": spec.grad_clip or 0.0, "seed": spec.seed,
            "bf16": spec.precision == "bf16", "fp16": spec.precision == "fp16"}


def _fsdp_words(spec: Spec) -> str:
    words = {"full": "full_shard", "grad_op": "shard_grad_op", "none": "no_shard",
             "hybrid": "hybrid_shard", "hybrid_grad_op": "hybrid_shard_zero2"}
    extra = ["offload"] if spec.offload == "params" else []
    return " ".join([words[spec.shard], "auto_wrap", *extra])


def _layers(spec: Spec) -> dict:
    return ({"transformer_layer_cls_to_wrap": list(spec.wrap.layer_classes)}
            if spec.wrap.layer_classes else {})


def _trainer_fsdp(spec: Spec) -> dict:
    config = {"backward_prefetch": spec.fsdp.backward_prefetch.replace("none", "no_prefetch"),
              "forward_prefetch": spec.fsdp.forward_prefetch,
              "use_orig_params": spec.fsdp.use_orig_params,
              "sync_module_states": spec.fsdp.sync_module_states,
              "cpu_ram_efficient_loading": spec.fsdp.cpu_ram_efficient_loading,
              "activation_checkpointing": spec.activation_checkpointing, **_layers(spec)}
    return {**_trainer_args(spec), "fsdp": _fsdp_words(spec), "fsdp_config": config}


def _trainer_xla(spec: Spec) -> dict:
    config = {"xla": True, "xla_fsdp_v2": spec.xla.fsdp_version == 2,
              "xla_fsdp_grad_ckpt": spec.checkpoint_activations,
              "xla_fsdp_settings": {k: v for k, v in spec.xla.xla_fsdp_settings.items()
                                    if k != "xla_fsdp_grad_ckpt"}, **_layers(spec)}
    return {**_trainer_args(spec), "fsdp": _fsdp_words(spec), "fsdp_config": config}


def _trainer_deepspeed(spec: Spec) -> dict:
    return {**_trainer_args(spec), "deepspeed": to_deepspeed(spec)}


TRAINER = {"fsdp": _trainer_fsdp, "xla_fsdp": _trainer_xla, "deepspeed": _trainer_deepspeed}


def to_hf_trainer(spec: Spec) -> dict:
    """Keyword arguments for transformers.TrainingArguments (output_dir is the caller's)."""
    return TRAINER[spec.backend](spec)


EXPORTERS = {"accelerate": to_accelerate, "deepspeed": to_deepspeed, "hf-trainer": to_hf_trainer}
