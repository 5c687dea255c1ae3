"""What a step minimises, whatever the layout: the loss one process computes on the global batch.

A Hugging Face model's loss is a mean over the items it predicts: a causal LM's over every target token
of the batch (labels != -100 after the shift), a masked LM's over its masked positions. Split over ranks
and micro-batches, a mean of per-part means weighs every part alike whatever number of targets it holds:
with padded SFT rows that is another objective (measured on a tiny Llama: 7.6e-3 off at step 1 at 2
ranks). Here each micro-batch's mean is weighed by its own count over the step's global count instead,
so the loss and the gradient are those of one process on the global batch (Hugging Face Trainer's
`num_items_in_batch` with `average_tokens_across_devices`, except that Trainer counts labels before the
shift, including the first position, which no token predicts).

The global count costs one reduction of one number per step, launched before the first forward and
waited for at the first backward (on NCCL a stream wait: no host sync). Where polyshard does not know
what a model's loss averages over (a classification head, a model of your own), every micro-batch
weighs alike, which is exact for a per-sample mean; `count_fn` declares the count of a loss of your own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

IGNORE_INDEX = -100  # what every Hugging Face loss ignores (CrossEntropyLoss's default too)
CountFn = Callable[[Any], torch.Tensor | int]

# transformers' auto-class tables: the model classes whose `labels` loss is a mean over target tokens.
SHIFTED = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",)  # labels[..., 1:] are the targets
UNSHIFTED = ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
             "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
             "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES")


@functools.cache
def _classes(tables: tuple[str, ...]) -> frozenset[str]:
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return frozenset()
    names: set[str] = set()
    for table in tables:
        for value in getattr(modeling_auto, table, {}).values():
            names.update(value if isinstance(value, (tuple, list)) else (value,))
    return frozenset(names)


def base_model(model: nn.Module) -> nn.Module:
    """The model under a PEFT wrapper (PeftModel.get_base_model), else the model."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def label_count(model: nn.Module) -> CountFn | None:
    """How many items a Hugging Face model's `labels` loss averages over in a batch, or None when it
    is not a token mean polyshard knows (then every micro-batch weighs alike)."""
    name = type(base_model(model)).__name__
    if name in _classes(SHIFTED):
        return count_shifted
    if name in _classes(UNSHIFTED):
        return count_labels
    return None


def count_shifted(batch) -> torch.Tensor:
    """Causal LM: position t predicts token t + 1, so the first label is never a target (HF's
    ForCausalLMLoss pads the end and shifts); `shift_labels`, when given, are the targets as they are."""
    if "shift_labels" in batch:
        return (batch["shift_labels"] != IGNORE_INDEX).sum()
    return (batch["labels"][..., 1:] != IGNORE_INDEX).sum()


def count_labels(batch) -> torch.Tensor:
    return (batch["labels"] != IGNORE_INDEX).sum()


class Objective:
    """Weighs each micro-batch's loss. `count` None: every micro-batch alike (the mean of means)."""

    def __init__(self, count: CountFn | None, data_parallel: int):
        self.count = count
        self.data_parallel = data_parallel  # gradients are averaged over this many processes

    @classmethod
    def for_model(cls, model: nn.Module, count_fn: CountFn | None, has_loss_fn: bool,
                  weighting: str, data_parallel: int) -> Objective:
        if weighting == "micro_batches":
            return cls(None, data_parallel)
        if count_fn is not None:
            return cls(count_fn, data_parallel)
        return cls(None if has_loss_fn else label_count(model), data_parallel)

    def counts(self, micro_batches: list) -> torch.Tensor | None:
        """Items per micro-batch as one int64 tensor on the batch's device (no host read; exact at
        any batch, where float32 stops counting exactly at 2**24 tokens), or None."""
        if self.count is None or not isinstance(micro_batches[0], dict) or (
                self.count in (count_shifted, count_labels) and "labels" not in micro_batches[0]):
            return None
        device = next(iter(micro_batches[0].values())).device
        return torch.stack([torch.as_tensor(self.count(m), device=device).long()
                            for m in micro_batches])

    def share(self, loss: torch.Tensor, i: int, counts: torch.Tensor | None, total,
              parts: int) -> torch.Tensor:
        """Micro-batch i's part of the step's loss on this rank, scaled so that averaging over the
        data-parallel processes (what every backend's gradient reduction does) gives the global mean.
        A micro-batch without targets adds exactly zero (its own mean is 0/0)."""
        if counts is None:
            return loss / parts
        n = counts[i]
        kept = torch.where(n > 0, loss, torch.zeros_like(loss))
        return kept * (n * self.data_parallel / total())
