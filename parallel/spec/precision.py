"""Precision's sections and rules: dynamic loss scaling (`precision: fp16`) and float8 training
(`precision: fp8`: torchao's Float8Linear, docs/precision.md). The engine's side of float8 is
parallel/engine/model/float8.py; here are the fields and what they may be combined with."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from parallel.spec.sections import Section

# torchtitan's filter, in Hugging Face's names: the head (lm_head; torchtitan's `output`; a
# classification head's `score`) and MoE routers (Mixtral's and Qwen-MoE's `gate`, their shared
# expert's gate, Llama 4's `router`) stay in high precision
KEEP_HIGH = ("lm_head", "output", "score", "gate", "shared_expert_gate", "router")


class LossScale(Section):
    """Dynamic loss scaling for `precision: fp16` (FSDP's ShardedGradScaler, DeepSpeed's fp16 block)."""

    initial_scale_power: Annotated[
        int, Field(ge=0, le=32, description="Start at 2**initial_scale_power.")
    ] = 16
    growth_interval: Annotated[
        int, Field(ge=1, description="Steps without overflow before the scale doubles.")
    ] = 1000
    hysteresis: Annotated[
        int, Field(ge=1, description="Overflows tolerated before the scale halves (DeepSpeed).")
    ] = 2
    min_scale: Annotated[float, Field(gt=0, description="The scale never drops below this.")] = 1.0


class Float8(Section):
    """float8 training (`precision: fp8`): the model's nn.Linear layers become torchao's Float8Linear,
    whose matmuls (forward, and both of backward's) run in float8 with dynamic scales; everything
    else runs in `base`."""

    recipe: Annotated[
        Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"],
        Field(description="torchao's scaling recipe. tensorwise: one scale per tensor (the fastest; "
              "torchtitan's +28% at 8B). rowwise: one scale per row, more accurate. "
              "rowwise_with_gw_hp: rowwise, with the weight's gradient computed in high precision."),
    ] = "tensorwise"
    base: Annotated[
        Literal["bf16", "fp32"],
        Field(description="The dtype everything but the float8 matmuls computes in. bf16 "
              "(default, torchtitan's): bf16 mixed precision, master weights, gradient reduction "
              "and optimizer state fp32 as with precision: bf16. fp32: fp32 outside the matmuls "
              "(what the parity tests compare against one process)."),
    ] = "bf16"
    keep_high_precision: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=200)]],
        Field(max_length=256, description="Linear layers left in `base`, by module name: a pattern "
              "(fnmatch) matches a name or any dotted suffix of it. Default: heads and MoE routers "
              "(torchtitan's filter). Linears whose dimensions are not multiples of 16 always stay "
              "(float8 matmuls need them), and are named at prepare."),
    ] = list(KEEP_HIGH)
    all_gather: Annotated[
        bool,
        Field(description="FSDP2 with recipe tensorwise: gather parameters in float8 (half of "
              "bf16's bytes), each weight's scale computed over the whole weight after every "
              "optimizer step (one all-reduce for every weight; torchao's "
              "precompute_float8_dynamic_scale_for_fsdp)."),
    ] = False
    emulate: Annotated[
        bool | None,
        Field(description="Run the float8 casts but matmul in `base` (torchao's emulate). Unset: "
              "emulate where the device has no float8 matmul (CPU; GPUs below compute capability "
              "8.9), saying so at prepare."),
    ] = None


def precision_problems(spec) -> list[tuple[str, str]]:
    """The rules between a Spec's precision, loss_scale and float8."""
    out = []
    if spec.loss_scale != LossScale() and spec.precision != "fp16":
        out.append(("loss_scale", f"loss scaling applies to precision: fp16 only, not "
                    f"{spec.precision!r}; remove loss_scale or use precision: fp16"))
    if spec.float8 != Float8() and spec.precision != "fp8":  # a full dump holds the defaults
        out.append(("float8", f"is read only with precision: fp8, not {spec.precision!r}; remove "
                    "the float8 section or set precision: fp8"))
    f8 = spec.float8
    if f8.all_gather and f8.recipe != "tensorwise":
        out.append(("float8.all_gather", f"true with recipe {f8.recipe!r}: torchao gathers float8 "
                    "weights with one scale per tensor only; use recipe: tensorwise or "
                    "all_gather: false"))
    return out
