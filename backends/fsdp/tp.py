"""Tensor parallelism for FSDP2 (`topology.tp`, docs/tp.md). torchtitan's order: the TP plan first
(parallelize_module over mesh["tp"]), then activation checkpointing, compile and fully_shard over the
data-parallel dims, so FSDP2 shards the TP shards again (`_StridedShard`). Which plan, and its checks
against the model: parallel/engine/tp_plan.py."""

from __future__ import annotations

from torch import nn

from parallel.engine.tp_plan import STYLES


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
