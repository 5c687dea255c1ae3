"""Tensor parallelism for FSDP2 (`topology.tp`, docs/tp.md). torchtitan's order: the TP plan first
(parallelize_module over mesh["tp"]), then activation checkpointing, compile and fully_shard over the
data-parallel dims, so FSDP2 shards the TP shards again (`_StridedShard`). Which plan, and its checks
against the model: parallel/engine/tp_plan.py."""

from __future__ import annotations

import torch
from torch import nn

STYLES = ("colwise", "rowwise", "colwise_rep")


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
