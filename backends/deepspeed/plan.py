"""DeepSpeed's memory and communication model for `polyshard plan` (measured, docs/deepspeed.md).

Model states: low-precision parameters (ZeRO-3: a partition), the partition's gradients (DeepSpeed
0.19.8 keeps only those at stage 1 too), and an fp32 master partition with the optimizer's state;
ZeRO-0 in fp32 is the client optimizer on the module's own parameters. Communication: ZeRO-1/2
all-reduce gradient buckets unless use_multi_rank_bucket_allreduce is false (3 Psi, else the
paper's 2 Psi); ZeRO-3 gathers each parameter once per step on models within
stage3_max_live_parameters (2 Psi), 3 Psi beyond.
"""

from __future__ import annotations

from backends.deepspeed.config.translate import STAGES, fill_sized, model_sized, translate
from parallel.kits.sizes import flat, numel


def model_states(spec, shapes, n: int, low: int, opt: int) -> tuple[float, float, float]:
    psi, stage = numel(shapes), STAGES[spec.shard]
    if stage == 0 and low == 4:  # fp32 ZeRO-0: the client optimizer on the module's parameters
        return 4.0 * psi, 4.0 * psi, float(opt * psi)
    part = flat(shapes, n) if stage else psi
    return low * (part if stage == 3 else psi), low * part, (4 + opt) * part


def transient(spec, psi: float, unit: float, low: int, hidden: int | None = None
              ) -> tuple[float, float]:
    """ZeRO-3: up to stage3_max_live_parameters gathered (a model below it stays gathered from
    forward to backward, measured: docs/deepspeed.md), plus the prefetch bucket. ZeRO-0/1/2: none
    gathered (parameters are whole). Buffers: the reduce bucket (reduce_bucket_size elements, in
    the reduce dtype) and, at stages 1/2, the all-gather bucket of updated parameters. With
    contiguous_gradients (DeepSpeed's default) stages 1-3 allocate the whole reduce bucket whatever
    the model's size, twice at stages 1/2 with overlap_comm (measured with `polyshard bench`: 5e8
    fp32 elements, 1907 MiB per rank, for a 3 M-parameter model; docs/deepspeed.md), so unless the
    spec sets it the bucket is min(5e8, psi) (translate.py: MODEL_SIZED); a file's "auto" follows
    HF's rule from the model's `hidden` size."""
    zero = translate(spec)["config"]["zero_optimization"]
    # the model-sized defaults, as prepare fills them (translate.py: MODEL_SIZED; a file's "auto"
    # needs the hidden size, DeepSpeed's defaults where it is unknown)
    zero = fill_sized({"zero_optimization": zero}, hidden, psi)["zero_optimization"] \
        if hidden is not None or not any(v == "auto" for v in zero.values()) else zero
    zero = {k: v for k, v in zero.items() if not model_sized(v)}
    stage, red = STAGES[spec.shard], {"fp32": 4, "bf16": 2, "fp16": 2}[spec.grad_reduce_dtype]
    elements = float(zero.get("reduce_bucket_size", 5e8))
    if stage and zero.get("contiguous_gradients", True):
        double = stage in (1, 2) and zero.get("overlap_comm", False)
        bucket = elements * red * (2 if double else 1)
    else:
        bucket = min(psi, elements) * red
    if stage == 3:
        live = min(psi, float(zero.get("stage3_max_live_parameters", 1e9))
                   + float(zero.get("stage3_prefetch_bucket_size", 5e7)))
        return live * low, bucket
    gather = min(psi, float(zero.get("allgather_bucket_size", 5e8))) * low if stage else 0.0
    return 0.0, bucket + gather


def comm(spec, psi: float, output_share: float = 0.0, root_share: float = 0.0) -> float:
    stage = STAGES[spec.shard]
    zero = translate(spec)["config"]["zero_optimization"]
    if stage in (1, 2):
        return 3.0 if zero.get("use_multi_rank_bucket_allreduce", True) else 2.0
    if stage == 3:
        return 2.0 if psi <= zero.get("stage3_max_live_parameters", 1e9) else 3.0
    return 2.0
