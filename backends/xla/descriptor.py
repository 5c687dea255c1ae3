"""Everything polyshard knows about PyTorch/XLA FSDP (parallel/descriptor.py), without importing
torch_xla."""

from __future__ import annotations

from backends.xla import accelerate, exports, plan
from backends.xla.translate import local_run, translate
from backends.xla.options import XlaOptions
from parallel.descriptor import (BackendDescriptor, Bench, Capabilities, Checkpoints, Interop,
                                 Launch, Options, PlanModel, Unsupported)
from parallel.envinfo import detect_pjrt_device

NO_HYBRID = "XLA FSDP has no hybrid (replicate x shard) mode"

DESCRIPTOR = BackendDescriptor(
    name="xla_fsdp",
    summary="PyTorch/XLA FSDP: XlaFullyShardedDataParallel (v1) or SPMD FSDPv2 (v2)",
    capabilities=Capabilities(unsupported={
        "shard": {
            "optimizer": Unsupported("XLA FSDP shards parameters; it has no optimizer-only mode",
                                     "shard: grad_op, or backend: deepspeed"),
            "none": Unsupported("XlaFullyShardedDataParallel always shards parameters",
                                "shard: grad_op (keeps full parameters between forward and "
                                "backward)"),
            "hybrid": Unsupported(NO_HYBRID, "shard: full"),
            "hybrid_grad_op": Unsupported(NO_HYBRID, "shard: grad_op"),
        },
        "topology.device": {"tpu": Unsupported(
            "backend xla_fsdp drives TPUs through torch_xla's PJRT client (PJRT_DEVICE=TPU); tpu is "
            "TorchTPU's device, a different runtime", "topology.device: auto (PJRT_DEVICE picks "
            "the chips), or backend: fsdp for TorchTPU")},
        "offload": {"optimizer": Unsupported("XLA FSDP has no CPU offload", "offload: none"),
                    "params": Unsupported("XLA FSDP has no CPU offload", "offload: none")},
        "precision": {"fp16": Unsupported("TPUs compute in bf16; XLA FSDP has no fp16 loss "
                                          "scaling", "precision: bf16"),
                      "fp8": Unsupported("torchao's Float8Linear runs on torch's eager and compiled "
                                         "paths, not as an XLA graph, and TPUs up to v5 have no "
                                         "float8 matmul", "precision: bf16, or backend: fsdp")},
        "sequence.offload_activations": {True: Unsupported(
            "an XLA graph keeps its saved activations on the device (torch's save_on_cpu would "
            "move them out of the graph at every step)", "activation_checkpointing: true")},
        "checkpoint.async_save": {True: Unsupported(
            "XLA's checkpoints are written from device tensors by its own planners (SPMD) or "
            "gathered through XLA collectives (v1), which a background thread cannot drive",
            "checkpoint.async_save: false")},
        "compile.enabled": {True: Unsupported(
            "PyTorch/XLA already compiles: each step's forward, backward and optimizer update are "
            "traced into one XLA graph, compiled once per shape and cached; torch.compile's "
            "openxla backend is experimental for training and splits that graph in three "
            "(forward, backward, optimizer), which XLA optimises less well (docs/compile.md)",
            "compile.enabled: false")},
    }, exports={"accelerate": Unsupported("accelerate has no XLA FSDP",
                                          "--to hf-trainer (TrainingArguments' fsdp_config.xla)")}),
    translate=translate,
    engine="backends.xla.engine:make_engine",
    extra="xla",
    packages=("torch_xla",),
    # SPMD (v2) only: the mesh's model and seq axes; translate refuses both on v1
    dimensions=frozenset({"tp", "cp"}),
    lacking={"ep": "the dispatch is an all-to-all whose split sizes the routing decides at "
                   "run time, which torch_xla 2.9 refuses; FSDP2 runs ep"},
    options=Options("xla", XlaOptions, "PyTorch/XLA only knobs."),
    variants={"xla1": {"xla": {"fsdp_version": 1}}, "xla2": {"xla": {"fsdp_version": 2}}},
    flat_optimizer=lambda spec: spec.xla.fsdp_version == 1,  # flatten_parameters: one per unit
    plan=PlanModel(plan.model_states, plan.comm, plan.transient),
    launch=Launch(
        # PJRT_DEVICE set explicitly, so nothing guesses (transformers prints "Defaulting to CPU")
        env=lambda: {"PJRT_DEVICE": detect_pjrt_device(), "USE_TORCH_XLA": "1"},
        local_run=local_run,
        accelerator="",  # TPU VMs: no GPU resource to request
        # SPMD (v2): one process drives every local device; how many is known at run time
        process_devices=lambda spec: None if spec.xla.fsdp_version == 2 else 1,
        in_process_refusal=lambda spec: (
            "xla.fsdp_version 1 with several processes needs torch_xla's own multi-process start "
            "(xmp.spawn sets PJRT up per chip): use `polyshard launch`, or xla.fsdp_version: 2 "
            "(one process drives every chip of the host)"
            if spec.xla.fsdp_version == 1 and spec.world_size > 1 else None)),
    interop=Interop(
        exports={"hf-trainer": exports.to_hf_trainer},
        accelerate_claims=accelerate.claims,
        accelerate_section=accelerate.section,
        accelerate_keys=frozenset({"xla"})),  # transformers' guide also puts it at the top level
    checkpoints=Checkpoints(readers={"xla": "backends.xla.native_checkpoint:read_xla"}),
    bench=Bench(
        native=lambda spec: (("native_xla.py", ["--flatten"] if spec.xla.flatten_parameters
                              else []) if spec.xla.fsdp_version == 1 else None),
        comm_counted=False),  # compiled into the graph: c10d never sees them
)
