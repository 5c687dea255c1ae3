"""Tensor parallelism for FSDP2 (`topology.tp`, docs/tp.md). torchtitan's order: the TP plan first (parallelize_module over
mesh["tp"]), then activation checkpointing, compile and fully_shard over the data-parallel dims, so
FSDP2 shards the TP shards again (`_StridedShard`).

The plan is the model's own: transformers ships `base_model_tp_plan` (Llama: q/k/v/gate/up colwise,
o/down rowwise) and `_tp_plan` (lm_head `colwise_rep`); a Megatron column/row split of the attention
and MLP projections. What the plan leaves out (embeddings, norms) stays whole on every TP rank."""

from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch import nn

from parallel.spec.io import SpecError

STYLES = ("colwise", "rowwise", "colwise_rep")


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan as {module path (fnmatch, from the model's root): style},
    from transformers' `base_model_tp_plan` (under the base model's attribute) and the head
    class's `_tp_plan`; {} for a model without one."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix if prefix and hasattr(model, prefix) else ""
    plan = {f"{inner}.{k}" if inner else k: v for k, v in base.items()}
    # the head's plan from the class: transformers 4.57's post_init replaces the instance's
    # `_tp_plan` with the config's base plan (unprefixed), losing {"lm_head": "colwise_rep"}
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    return plan


def resolve_plan(model: nn.Module, tp: int, spec_plan: dict[str, str] | None) -> dict[str, str]:
    """The plan a job splits by (the spec's `topology.tp_plan`, else the model's own), after
    checking that every entry names Linear layers and that what it splits divides by tp: a
    projection's split side and the attention's head counts (each rank runs heads / tp heads)."""
    field = "topology.tp_plan" if spec_plan is not None else "topology.tp"
    plan = spec_plan if spec_plan is not None else hf_tp_plan(model)
    if not plan:
        raise SpecError([("topology.tp_plan", f"unset, and {type(model).__name__} has no tp plan of "
                          "its own (Hugging Face's base_model_tp_plan); give {module path: colwise "
                          "| rowwise | colwise_rep} for its projections")])
    problems = []
    for key, value in _head_counts(model).items():
        if value % tp:
            problems.append((field, f"tp {tp} does not divide the model's {key} {value}; pick a "
                             "divisor"))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for pattern, style in plan.items():
        hits = [(n, m) for n, m in linears.items() if fnmatch(n, pattern)]
        if not hits:
            problems.append((field, f"{pattern!r} ({style}) matches no Linear layer of "
                             f"{type(model).__name__}; module paths start at the model's root"))
        for name, m in hits[:1]:  # a pattern's layers share their shape
            size = m.in_features if style == "rowwise" else m.out_features
            if size % tp:
                problems.append((field, f"tp {tp} does not divide {name}'s "
                                 f"{'in' if style == 'rowwise' else 'out'}_features {size} "
                                 f"({style}); pick a divisor"))
    if problems:
        raise SpecError(problems)
    return dict(plan)


def _head_counts(model: nn.Module) -> dict[str, int]:
    config = getattr(model, "config", None)
    names = ("num_attention_heads", "num_key_value_heads")
    return {n: getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)}


def parallel_style(style: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "colwise_rep":  # the head: vocabulary split, logits gathered whole for the loss
        return ColwiseParallel(output_layouts=Replicate())
    raise ValueError(f"tp plan style {style!r}: polyshard knows {', '.join(STYLES)}")


def apply_tp(model: nn.Module, tp_mesh, plan: dict[str, str]) -> None:
    """Split the plan's modules over `tp_mesh` in place. Heads are split, so each rank's attention
    sees num_heads / tp heads: transformers' attention reshapes with -1 heads and runs as is."""
    from torch.distributed.tensor.parallel import parallelize_module

    # src_data_rank=None: each rank keeps its own chunk, no scatter from the TP group's first
    # rank. Every rank holds the same weights already (one seed, or sync_module_states' broadcast),
    # as fully_shard assumes too; and with cpu_ram_efficient_loading the ranks but 0 hold meta
    # tensors that cannot join a scatter (measured: the default scatter hung ranks 0-1 of 4).
    parallelize_module(model, tp_mesh, {path: parallel_style(s) for path, s in plan.items()},
                       src_data_rank=None)


def clip_grad_norm_by_mesh(params, max_norm: float | None) -> torch.Tensor:
    """The global gradient norm (and clipping to max_norm) when gradients live on different meshes:
    with TP + FSDP2 the split projections are DTensors over (dp_shard, tp) and the rest over
    dp_shard alone, and torch's clip_grad_norm_ stacks the per-tensor norms, which DTensor refuses
    across meshes (measured: "All operands in aten.stack.default must have the same mesh").
    Each mesh's norm is reduced in full over its own mesh, then the squares are summed."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None,
                              []).append(p)
    squares = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in members], 2.0)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
    if max_norm is not None:
        for members in groups.values():
            torch.nn.utils.clip_grads_with_norm_(members, max_norm, total)
    return total
