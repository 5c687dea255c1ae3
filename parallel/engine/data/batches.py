"""A step's batch as the step handles it: split into micro-batches, moved to the device once per
tensor, and measured (tokens, sequence width) for throughput and FLOPs."""

from __future__ import annotations

import torch


def split_micro_batches(batch, accum: int) -> list:
    """A step's batch (dict or tuple of tensors) as `accum` micro-batches along dim 0."""
    if accum == 1:
        return [batch]
    if isinstance(batch, dict):
        parts = {k: torch.tensor_split(v, accum) for k, v in batch.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(accum)]
    return list(zip(*(torch.tensor_split(v, accum) for v in batch)))


def to_device(batch, device):
    """Each distinct tensor moved once: a batch that passes one tensor as input_ids and labels (the
    causal-LM habit) costs one host-to-device copy, not two (on XLA, a transfer every step)."""
    moved: dict[int, torch.Tensor] = {}

    def move(v: torch.Tensor) -> torch.Tensor:
        if id(v) not in moved:
            moved[id(v)] = v.to(device, non_blocking=True)
        return moved[id(v)]

    if isinstance(batch, dict):
        return {k: move(v) for k, v in batch.items()}
    return type(batch)(move(v) for v in batch)


def count_tokens(batch) -> int:
    if isinstance(batch, dict) and "input_ids" in batch:
        return batch["input_ids"].numel()
    return first_tensor(batch).numel()


def batch_width(batch) -> int:
    """The sequence width of a token batch (the attention term of FLOPs per token), 1 otherwise."""
    t = batch["input_ids"] if isinstance(batch, dict) and "input_ids" in batch else first_tensor(batch)
    return t.shape[-1] if t.dim() > 1 else 1


def first_tensor(batch) -> torch.Tensor:
    return next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
