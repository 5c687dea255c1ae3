"""A spec as the files other tools take: the vocabulary every backend's exports share (a kit: backends
import it, it imports no backend). What each backend writes lives in its package
(backends/<name>/exports.py, listed by its descriptor); parallel/interop/export.py dispatches.

Accelerate exports mean what the spec means under accelerate 1.11's launcher (checked by importing them
back and by accelerate's own plugin classes in tests/unit/test_real_configs.py): every key is written,
none is left to a default."""

from __future__ import annotations

from parallel.interop.importing import PREFETCH, STRATEGIES
from parallel.spec.errors import SpecError
from parallel.spec.model import Spec

STRATEGY_OF = {v: k for k, v in STRATEGIES.items()}
PREFETCH_OF = {v: k for k, v in PREFETCH.items()}
MIXED = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def accelerate_wrap(spec: Spec) -> dict:
    policy = spec.wrap.policy
    if policy == "size":
        return {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "fsdp_min_num_params": spec.wrap.min_num_params}
    if policy == "none":
        return {"fsdp_auto_wrap_policy": "NO_WRAP"}
    wrap = {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}
    if spec.wrap.layer_classes:  # `auto` lets accelerate read _no_split_modules, as polyshard does
        wrap["fsdp_transformer_layer_cls_to_wrap"] = ",".join(spec.wrap.layer_classes)
    return wrap


def no_float8(spec: Spec, tool: str) -> None:
    """precision: fp8 is not exported: accelerate's and the Trainer's float8 switches pick their
    own recipe and filter (accelerate's AORecipeKwargs), so the file would not mean this spec."""
    if spec.precision == "fp8":
        raise SpecError([("precision", f"fp8 has no {tool} counterpart polyshard can write with the "
                          "same recipe and layers kept in high precision; export with precision: "
                          "bf16 and add the tool's float8 settings by hand")])


def common_accelerate(spec: Spec) -> dict:
    no_float8(spec, "accelerate")
    nodes = spec.topology.nodes
    common = {"compute_environment": "LOCAL_MACHINE", "debug": False, "machine_rank": 0,
              "main_training_function": "main", "mixed_precision": MIXED[spec.precision],
              "num_machines": nodes, "num_processes": spec.world_size,
              "rdzv_backend": "c10d" if nodes > 1 else "static", "same_network": nodes == 1,
              "use_cpu": False}
    if spec.topology.rdzv_endpoint:
        host, _, port = spec.topology.rdzv_endpoint.rpartition(":")
        common.update(main_process_ip=host, main_process_port=int(port))
    if spec.compile.enabled:
        common["dynamo_config"] = accelerate_dynamo(spec)
    return common


def accelerate_dynamo(spec: Spec) -> dict:
    """`compile` as accelerate's dynamo_config (the inverse of parallel/interop/accelerate.py)."""
    c = spec.compile
    if c.dynamic is None:  # accelerate launch always passes dynamic=True or False
        raise SpecError([("compile.dynamic", "None (torch's automatic dynamic shapes) has no "
                          "accelerate equivalent: accelerate launch passes dynamic=False unless "
                          "told true; set compile.dynamic: false or true")])
    return {"dynamo_backend": c.backend.upper(), "dynamo_mode": c.mode,
            "dynamo_use_fullgraph": c.fullgraph, "dynamo_use_dynamic": c.dynamic,
            "dynamo_use_regional_compilation": c.scope == "blocks"}


def trainer_document(arguments: dict, environment: dict[str, str] | None = None) -> dict:
    """What `--to hf-trainer` writes: TrainingArguments' keyword arguments, and the environment the
    training processes need for what TrainingArguments has no field for (none since transformers 5,
    whose fsdp_config carries the FSDP version). Use it as
    `os.environ.update(doc["environment"]); TrainingArguments(**doc["training_arguments"])`."""
    return {"training_arguments": arguments, "environment": environment or {}}


def trainer_args(spec: Spec) -> dict:
    no_float8(spec, "Hugging Face Trainer")
    return {"per_device_train_batch_size": spec.micro_batch_size,
            "gradient_accumulation_steps": spec.grad_accum_steps,
            "max_grad_norm": spec.grad_clip or 0.0, "seed": spec.seed,
            "bf16": spec.precision == "bf16", "fp16": spec.precision == "fp16"}


def trainer_sharding(spec: Spec, version: int) -> dict:
    """TrainingArguments' FSDP as transformers 5 takes it: `fsdp: true` and, in fsdp_config, the
    version and `reshard_after_forward` (FSDP2: a bool, full_shard or shard_grad_op only; FSDP1: the
    strategy's name). Its string form (`fsdp="full_shard auto_wrap"`) is deprecated, and
    fsdp_config's version defaults to 2 (transformers 4.57: accelerate's FSDP_VERSION, default 1)."""
    words = {"full": "full_shard", "grad_op": "shard_grad_op", "none": "no_shard",
             "hybrid": "hybrid_shard", "hybrid_grad_op": "hybrid_shard_zero2"}
    if version == 2 and spec.shard not in ("full", "grad_op"):
        raise SpecError([("shard", f"{spec.shard}: TrainingArguments runs FSDP2 as full_shard or "
                          "shard_grad_op only (transformers 5 refuses the others with FSDP2); export "
                          "--to accelerate (its parallelism_config has dp_replicate) or use fsdp.version 1")])
    config = {"version": version,
              "reshard_after_forward": spec.shard == "full" if version == 2 else words[spec.shard]}
    return {**config, "cpu_offload": True} if spec.offload == "params" else config


def trainer_layers(spec: Spec) -> dict:
    return ({"transformer_layer_cls_to_wrap": list(spec.wrap.layer_classes)}
            if spec.wrap.layer_classes else {})
