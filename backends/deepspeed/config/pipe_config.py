"""topology.pp on DeepSpeed, as plain data: what its pipeline engine (PipelineModule run by
PipelineEngine's 1F1B TrainSchedule, pipe.py) runs with one process's numbers, the config it takes,
and what is refused with the measured reason (docs/pipeline.md). No deepspeed import.

Measured with DeepSpeed 0.19.8 on 2 gloo CPU ranks, tiny Llama, pp 2 (docs/pipeline.md):
- ZeRO-0 in fp32 matches one process (AdamW within 9.5e-7, SGD identical): what runs here.
- ZeRO-1: on torch 2.9 its first SGD update was 7.3e-4 off one process's (a gradient, as
  DeepSpeed#1488 reports); on torch 2.15 it trains as ZeRO-0 does (SGD lr 0.5, 4 steps: 4.8e-7 at
  pp 2 and at pp 2 x dp 2 with grad_accum 2), but its checkpoints would name the stage's parameters
  by PipelineModule's layer index (`0.part.model...`), which no other layout reads (not built).
- ZeRO-2 and ZeRO-3: PipelineEngine asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline
  parallelism".
- DeepSpeed's clipping under a pipeline (runtime/utils.py clip_grad_norm_) counts the gradients of
  the ranks whose model-parallel rank is 0 only, the first stage's: polyshard writes
  gradient_clipping 0 and clips over every stage itself (the pp group's one all-reduce, as on FSDP2).
"""

from __future__ import annotations

from parallel.spec.errors import SpecError

FSDP2 = "or backend: fsdp (FSDP2 runs every schedule, ZeRO-3-like sharding, tp and cp with pp)"


def pipeline_rules(spec, stage: int) -> list[tuple[str, str]]:
    """(field, message) for what DeepSpeed's pipeline engine does not run as one process does."""
    pp, out = spec.topology.pp, []
    if stage >= 2:
        out.append(("shard", f"{spec.shard!r} (ZeRO-{stage}) with topology.pp {pp}: DeepSpeed "
                    "0.19.8's pipeline engine asserts \"ZeRO-2 and ZeRO-3 are incompatible with "
                    f"pipeline parallelism\"; use shard: none (ZeRO-0), {FSDP2}"))
    elif stage == 1:
        out.append(("shard", f"'optimizer' (ZeRO-1) with topology.pp {pp}: DeepSpeed 0.19.8's "
                    "pipeline engine trains it as one process does on torch 2.15 (4.8e-7, as "
                    "ZeRO-0; 7.3e-4 off on torch 2.9), but polyshard's ZeRO-1 checkpoints of a "
                    "pipeline would name its parameters by layer index, which no other layout "
                    f"reads (not built); use shard: none (ZeRO-0), {FSDP2}"))
    if spec.pipeline.schedule != "1f1b":
        out.append(("pipeline.schedule", f"{spec.pipeline.schedule!r} on deepspeed: its pipeline "
                    f"engine runs its own 1F1B (TrainSchedule) only; use 1f1b, {FSDP2}"))
    for name in ("tp", "cp"):
        if getattr(spec.topology, name) > 1:
            out.append((f"topology.{name}", f"{getattr(spec.topology, name)} with topology.pp "
                        f"{pp} on deepspeed: polyshard runs DeepSpeed's pipeline over data "
                        f"parallelism only; use {name}: 1, {FSDP2}"))
    if spec.precision != "fp32":
        out.append(("precision", f"{spec.precision!r} with topology.pp {pp} on deepspeed: "
                    "DeepSpeed's pipeline engine is measured against one process in fp32 only; "
                    f"use precision: fp32, {FSDP2}"))
    if spec.compile.enabled:
        out.append(("compile.enabled", f"true with topology.pp {pp} on deepspeed: compiling "
                    f"DeepSpeed's pipeline stages is not measured; use compile.enabled: false, "
                    f"{FSDP2}"))
    return out


def apply_pipeline_config(spec, config: dict, origins: dict, stage: int) -> None:
    """The config under topology.pp: DeepSpeed's micro-batch is a pipeline micro-batch, and its
    accumulation steps are every pipeline micro-batch of the step (one TrainSchedule a step: the
    gradients reduced once). Clipping is polyshard's (see above)."""
    if spec.topology.pp == 1:
        return
    problems = pipeline_rules(spec, stage)
    if problems:
        raise SpecError(problems)
    n = spec.pipeline.microbatches or spec.micro_batch_size
    config["train_micro_batch_size_per_gpu"] = spec.micro_batch_size // n
    config["gradient_accumulation_steps"] = spec.grad_accum_steps * n
    config["gradient_clipping"] = 0.0
    origins.update({"train_micro_batch_size_per_gpu": "micro_batch_size / pipeline.microbatches",
                    "gradient_accumulation_steps": "grad_accum_steps x pipeline.microbatches",
                    "gradient_clipping": "grad_clip, applied by polyshard over every stage"})
