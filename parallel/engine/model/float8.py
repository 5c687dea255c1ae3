"""precision: fp8 (docs/precision.md): the model's nn.Linear layers become torchao's Float8Linear as
torchtitan converts them (`convert_to_float8_training` with a module filter), before any split or
shard, so every backend and layout trains the same converted model.

- `apply_float8`: the conversion, on the model as built (every backend's `_record_params`); the
  layers `float8.keep_high_precision` names and those whose dimensions are not multiples of 16
  stay nn.Linear.
- `empty_safe`: a converted layer given no rows (an unused expert) runs as nn.Linear.
- `Float8.refresh`: with float8.all_gather (FSDP2), each weight's scale for the next gather,
  computed over the whole weight after every optimizer step and every load (torchao's
  precompute_float8_dynamic_scale_for_fsdp: one all-reduce for all of them).
- `is_float8` / `float8_style`: torchao's float8 tensor-parallel styles for converted layers under
  topology.tp with the tensorwise recipe (torchtitan's choice; rowwise keeps torch's styles).

torchao is imported only here and only with precision: fp8 (`polyshard[fp8]`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from fnmatch import fnmatch

import torch
from torch import nn

from parallel.engine.model.moe.experts import fused_blocks
from parallel.spec.errors import SpecError
from parallel.spec.precision import Float8 as Float8Section

SIZE = 16  # torch._scaled_mm's rule: both dimensions of a float8 operand multiples of 16


def kept(name: str, patterns: list[str]) -> bool:
    """A pattern matches the module's name or any dotted suffix of it (`gate` matches
    model.layers.0.block_sparse_moe.gate, not gate_proj)."""
    return any(fnmatch(name, p) or fnmatch(name, f"*.{p}") for p in patterns)


def needs_emulation(device: torch.device) -> bool:
    """No float8 matmul: a CPU, or a GPU below compute capability 8.9 (torch._scaled_mm's)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)


def float8_config(section: Float8Section, emulate: bool, all_gather: bool):
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError:
        raise SpecError([("precision", "fp8 trains with torchao's Float8Linear, which is not "
                          "installed; pip install 'polyshard[fp8]' (torchao 0.14.1 for torch "
                          "2.9)")]) from None
    if section.recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather, emulate=emulate)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(section.recipe), emulate=emulate)


def empty_safe(module: nn.Module) -> None:
    """An empty input (an expert no token reached, run so that its gradient exists on every rank:
    moe/experts.py) skips the float8 casts, whose scales are a maximum over no element (torchao
    0.14.1 raises in backward: 'amax(): Expected reduction dim 0 to have non-zero size'). The
    output and gradients are empty or zero either way."""
    float8_forward = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return nn.functional.linear(x, module.weight.to(x.dtype), module.bias)
        return float8_forward(x)

    module.forward = forward


def batch_split(dims, accum: int) -> str:
    """How a step's global batch is divided into what one forward sees ('' if it is not)."""
    parts = [f"{n} {v}" for n, v in (("dp", dims.dp_size), ("cp", dims.cp)) if v > 1]
    return " x ".join(parts + ([f"{accum} micro-batches"] if accum > 1 else []))


def split_notice(recipe: str, split: str) -> str | None:
    """What a recipe's scales leave of one process's numbers when a step's batch is split (`split`:
    batch_split's words), or None where they are one process's."""
    if not split or recipe == "rowwise_with_gw_hp":
        return None
    if recipe == "tensorwise":
        return (f"float8.recipe tensorwise scales each matmul's input and output gradient by their "
                f"largest value over the tensor this rank computes ({split}), not over the global "
                "batch as one process does, so the float8 casts and the losses differ from one "
                "process's (measured on the tiny Llama at dp 2: 7.2e-3 in 5 AdamW steps; "
                "rowwise_with_gw_hp matches one process, docs/precision.md)")
    return (f"float8.recipe rowwise casts each weight gradient (output gradient^T x input) with one "
            f"scale per feature, taken over the tokens this rank computes ({split}), not over the "
            "global batch: where a feature's largest value differs across them by a power of two, "
            "the casts and the losses differ from one process's (measured on the tiny Llama at dp 2 "
            "x 2 micro-batches of padded rows: 3.6e-4 in 5 AdamW steps, torchao 0.18); "
            "rowwise_with_gw_hp keeps that gradient in high precision and matches one process "
            "(docs/precision.md)")


class Float8:
    """What apply_float8 did: the converted and kept layers' names, and whether it emulates."""

    def __init__(self, converted: list[str], kept_names: list[str], small: list[str],
                 emulated: bool, all_gather: bool):
        self.converted, self.kept, self.small = converted, kept_names, small
        self.emulated, self.all_gather = emulated, all_gather

    def refresh(self, parts: list[nn.Module]) -> None:
        """The float8 all-gather's scales from the weights as they are now (after a step or a
        load): torchao reads them at the next forward's gather."""
        if not self.all_gather:
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in parts:
            precompute_float8_dynamic_scale_for_fsdp(part)


def apply_float8(model: nn.Module, section: Float8Section, device: torch.device,
                 say: Callable[[str], None], split: str = "") -> Float8:
    """Convert `model`'s linears in place (before tp, compile, checkpointing and sharding:
    torchtitan's order, so each of those sees Float8Linear). `split`: how a step's batch is
    divided into the tensors a matmul sees (data-parallel ranks, cp, micro-batches), if it is."""
    from torchao.float8 import convert_to_float8_training

    emulate = needs_emulation(device) if section.emulate is None else section.emulate
    config = float8_config(section, emulate, section.all_gather)
    converted, kept_names, small = [], [], []

    def chosen(module: nn.Linear, name: str) -> bool:  # torchao asks for each linear
        if kept(name, section.keep_high_precision):
            kept_names.append(name)
        elif module.in_features % SIZE or module.out_features % SIZE:
            small.append(name)
        else:
            converted.append(name)
            return True
        return False

    convert_to_float8_training(model, config=config, module_filter_fn=chosen)
    for name in converted:
        empty_safe(model.get_submodule(name))
    if not converted:
        raise SpecError([("precision", f"fp8 converted no layer: of the model's linears, "
                          f"{len(kept_names)} match float8.keep_high_precision and {len(small)} "
                          f"have a dimension that is not a multiple of {SIZE}; use precision: bf16")])
    say(f"precision fp8 ({section.recipe}): {len(converted)} linear layers in float8, "
        f"{len(kept_names)} kept in {section.base} by float8.keep_high_precision "
        f"({', '.join(sorted({n.rsplit('.', 1)[-1] for n in kept_names})) or 'none'})"
        + (f", {len(small)} with dimensions not multiples of {SIZE}: {', '.join(small[:4])}"
           if small else "")
        + (f"; emulated (no float8 matmul on {device.type}: the casts and scales are float8's, the "
           f"matmuls run in {section.base})" if emulate else ""))
    fused = fused_blocks(model)
    if fused:  # torchao converts nn.Linear layers; transformers 5's experts are 3-D parameters
        say(f"precision fp8: the experts of {len(fused)} mixture-of-experts blocks such as "
            f"{fused[0][0]}.experts are fused 3-D tensors, not linear layers: they stay in "
            f"{section.base} (docs/precision.md)")
    notice = split_notice(section.recipe, split)
    if notice:
        say(notice)
    return Float8(converted, kept_names, small, emulate, section.all_gather)


def is_float8(module: nn.Module) -> bool:
    """A converted layer whose weight is cast with one scale per tensor (float8 TP styles)."""
    if type(module).__name__ != "Float8Linear":  # no torchao import without precision: fp8
        return False
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear) and (
        module.config.cast_config_weight.scaling_granularity is ScalingGranularity.TENSORWISE)


def float8_style(style: str):
    """torchao's float8 version of a tensor-parallel plan's style (tp_plan.STYLES): the input is
    cast to float8 before it is gathered or split (half the bytes), with its scale over the whole
    tensor."""
    from torch.distributed.tensor import Replicate
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    if style == "colwise":
        return Float8ColwiseParallel()
    if style == "rowwise":
        return Float8RowwiseParallel()
    return Float8ColwiseParallel(output_layouts=Replicate())
