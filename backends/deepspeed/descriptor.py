"""Everything polyshard knows about DeepSpeed ZeRO (parallel/descriptor.py), without importing
deepspeed."""

from __future__ import annotations

from backends.deepspeed import plan
from backends.deepspeed.config.options import DeepSpeedOptions
from backends.deepspeed.config.translate import STAGES, translate
from backends.deepspeed.files import accelerate, exports
from backends.deepspeed.files.interop import from_deepspeed_file
from parallel.descriptor import (BackendDescriptor, Bench, Capabilities, Checkpoints, Interop,
                                 Launch, Options, PlanModel, Unsupported)


def _pipeline_flags(spec) -> list[str]:
    """topology.pp: DeepSpeed's pipeline tutorial (PipelineModule, train_batch), its micro-batches
    the rows polyshard's pipeline micro-batches hold (every one of the step's in one schedule)."""
    if spec.topology.pp == 1:
        return []
    per = spec.micro_batch_size // (spec.pipeline.microbatches or spec.micro_batch_size)
    return [f"--pp={spec.topology.pp}",
            f"--microbatches={spec.micro_batch_size * spec.grad_accum_steps // per}"]


DESCRIPTOR = BackendDescriptor(
    name="deepspeed",
    summary="DeepSpeed ZeRO stages 0-3, CPU / NVMe offload",
    capabilities=Capabilities(unsupported={
        "shard": {"hybrid_grad_op": Unsupported(
            "ZeRO++ hierarchical partitioning (hpZ) applies to ZeRO-3 parameters only",
            "shard: hybrid (ZeRO-3 + hpZ), or shard: grad_op (ZeRO-2)")},
        "topology.device": {"tpu": Unsupported(
            "DeepSpeed 0.19.8 has no accelerator for TorchTPU's tpu device (its accelerators: "
            "cuda, cpu, xpu, hpu, npu, mps)",
            "backend: fsdp (FSDP2 runs TorchTPU), or backend: xla_fsdp (torch_xla)")},
    }),
    translate=translate,
    engine="backends.deepspeed.engine:make_engine",
    extra="deepspeed",
    packages=("deepspeed",),
    variants={f"zero{stage}": {"shard": shard} for shard, stage in STAGES.items()
              if not shard.startswith("hybrid")},
    # AutoTP at every ZeRO stage (autotp.py); translate refuses DeepCompile with it. pp: DeepSpeed's
    # pipeline engine at ZeRO-0 in fp32 (pipe_config.py says what else it refuses and why)
    dimensions=frozenset({"tp", "cp", "pp"}),
    # the measurements behind it: docs/moe.md ("What it does not do yet")
    lacking={"ep": "DeepSpeed 0.19.8's AutoEP fuses each block's experts into one tensor that "
                   "steps experts no rank used (1.6e-4 off one process by step 3, measured) "
                   "under names that are not the model's; FSDP2 runs ep exactly"},
    options=Options("deepspeed", DeepSpeedOptions, "DeepSpeed only knobs."),
    flat_optimizer=lambda spec: True,  # ZeRO's flat fp32 partitions (ZeRO-0 too: state.py)
    plan=PlanModel(plan.model_states, plan.comm, plan.transient),
    launch=Launch(env=lambda: {"USE_TORCH_XLA": "0"}),
    interop=Interop(
        exports={"accelerate": exports.to_accelerate, "hf-trainer": exports.to_hf_trainer},
        formats={"deepspeed": exports.to_deepspeed},
        accelerate_claims=accelerate.claims,
        accelerate_section=accelerate.section,
        config_importers={"deepspeed": from_deepspeed_file}),
    checkpoints=Checkpoints(
        readers={"deepspeed": "backends.deepspeed.checkpoint.native_checkpoint:read_deepspeed",
                 "deepspeed-universal":
                     "backends.deepspeed.checkpoint.native_checkpoint:read_deepspeed_universal"},
        writers={"deepspeed-universal": "backends.deepspeed.checkpoint.universal:write_universal"}),
    bench=Bench(native=lambda spec: ("native_deepspeed.py", [
        f"--stage={STAGES[spec.shard]}",
        *([f"--tp={spec.topology.tp}"] if spec.topology.tp > 1 else []),
        # topology.cp: DeepSpeed's own Ulysses (UlyssesSPAttentionHF), as its ALST tutorial runs it
        *([f"--sp={spec.topology.cp}"] if spec.topology.cp > 1 else []),
        *_pipeline_flags(spec)])),
)
