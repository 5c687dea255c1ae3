"""`topology.cp: N`, context parallelism as Ulysses (DeepSpeed's all-to-all sequence parallelism): each
rank of a cp group is fed the same rows and keeps 1/N of every row's tokens through the whole model;
attention alone needs every token, so around it an all-to-all trades the sequence split for a split of
the heads (each rank attends over the full sequence with N-th of the heads) and a second one trades it
back. Everything else (embeddings, MLPs, norms, the loss) is per token and runs on the local slice.

Why Ulysses and not torch's ring `context_parallel`: it works with any attention implementation the
model has (sdpa, eager; the mask is the model's own, made at full length), over gloo and NCCL alike,
on every backend (one mechanism: FSDP2 and DeepSpeed run this same code), and its traffic per layer
is 4 all-to-alls of one activation's 1/N, independent of N (ring attention needs CUDA SDPA and moves
keys and values N - 1 times). Its limit: cp must divide the query heads each rank holds (checked at
prepare); key/value heads it does not divide are repeated (`kv_repeat`).

The loss: labels are shifted at full length before the split (`shift_labels`, Hugging Face's own
argument), so the target of each rank's last token, which lives on the next rank, is not lost; each
rank's loss is the mean over its own targets and the objective weighs it by its count over the
count of every rank holding other tokens (data parallel x cp), so the step is one process's.

How it plugs into transformers: the model's `_attn_implementation` becomes "polyshard_ulysses", a
function registered with transformers' AttentionInterface that all-to-alls and calls the model's
own implementation (its `sdpa` or its module's `eager_attention_forward`). The registration holds no
state: the function finds its group on the attention module (`_polyshard_cp`, set at prepare).
"""

from __future__ import annotations

import copy
import math
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel.kits.objective import IGNORE_INDEX, base_model

NAME = "polyshard_ulysses"
INNER = ("sdpa", "eager")  # the implementations cp wraps (flash: the GPU's, not measured here)
SEQUENCE_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask")


def _exchange(x: torch.Tensor, group, scatter: int, gather: int) -> torch.Tensor:
    """All-to-all: `x` cut into `cp` chunks along `scatter`, chunk j sent to rank j of `group`; the
    chunks received joined along `gather` in rank order."""
    cp = dist.get_world_size(group)
    send = torch.stack(x.chunk(cp, dim=scatter)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather)


class _AllToAll(torch.autograd.Function):
    """_exchange with its gradient: the reverse exchange."""

    @staticmethod
    def forward(ctx, x, group, scatter: int, gather: int):
        ctx.group, ctx.dims = group, (scatter, gather)
        return _exchange(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad):
        scatter, gather = ctx.dims
        return _exchange(grad, ctx.group, gather, scatter), None, None, None


def ulysses_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function signature: (B, heads, local tokens, D) in, (B, local
    tokens, heads, D) out. The cp group is the module's (set at prepare)."""
    cp = getattr(module, "_polyshard_cp", None)
    if cp is None:
        raise RuntimeError(f"{NAME}: {type(module).__name__} was not marked by polyshard's "
                           "context parallelism at prepare (an attention module it did not find)")
    return cp.attend(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface

    if NAME not in AttentionInterface._global_mapping:  # stateless: registering twice is the same
        AttentionInterface.register(NAME, ulysses_attention)


def kv_repeat(config, tp: int, cp: int) -> tuple[int, str | None]:
    """(how many times each key/value head is repeated before the split, the problem if cp cannot
    split the heads): cp must divide each rank's query heads (num_attention_heads / tp). Where it
    does not divide its key/value heads (Llama-3-8B at tp 8: one per rank), each is repeated
    cp / gcd(kv, cp) times, as DeepSpeed's Ulysses does: the heads a rank attends with after the
    exchange then have their own keys and values (the grouping is unchanged, gradients sum back)."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads is None or (heads // tp) % cp:
        return 1, (f"num_attention_heads {heads} / tp {tp} = "
                   f"{None if heads is None else heads / tp:g} heads per rank, which cp {cp} "
                   "does not divide")
    local = kv // tp
    return (1 if local % cp == 0 else cp // math.gcd(local, cp)), None


class ContextParallel:
    """The cp group's split of each micro-batch (`shard`) and its attention (`attend`)."""

    def __init__(self, model: nn.Module, cp: int, rank: int, tp: int, say):
        base = base_model(model)
        self.config = config = getattr(base, "config", None)
        self.cp, self.rank, self.group, self.say = cp, rank, None, say
        self.real_tokens: torch.Tensor | None = None  # the last shard's, 1 where not padding
        inner = getattr(config, "_attn_implementation", None)
        if inner not in INNER:
            raise ValueError(f"topology.cp {cp}: {type(base).__name__}'s attention implementation "
                             f"is {inner!r}; context parallelism wraps {' or '.join(INNER)}: load "
                             "the model with attn_implementation='sdpa' (or 'eager'), or set cp: 1")
        self.kv_repeat, bad = kv_repeat(config, tp, cp)
        if bad:
            raise ValueError(f"topology.cp {cp}: {type(base).__name__}: {bad}; pick a cp that "
                             "divides it")
        self.inner = inner
        self.marked = self._mark(base)
        # the model's masks at full length, as its sdpa path makes them (boolean, or None where
        # causal alone is exact); eager turns them additive in `attend`
        self.mask_config = copy.copy(config)
        self.mask_config._attn_implementation_internal = "sdpa"
        self.padded = False  # said once
        if getattr(config, "output_router_logits", False):
            say(f"topology.cp {cp}: {type(base).__name__}'s load-balancing loss is computed from "
                f"each rank's 1/{cp} of the tokens, which does not add up to one process's over "
                "whole rows (as over data-parallel ranks: docs/moe.md)")
        _register()
        config._attn_implementation = NAME

    def _mark(self, base: nn.Module) -> int:
        marked = 0
        for module in base.modules():
            if getattr(module, "config", None) is self.config and hasattr(module, "head_dim") \
                    and hasattr(module, "is_causal"):
                module._polyshard_cp = self
                if self.inner == "eager":
                    module._polyshard_eager = self._eager_of(module)
                marked += 1
        if not marked:
            raise ValueError(f"topology.cp {self.cp}: no attention module of "
                             f"{type(base).__name__} found (a module with the model's config, "
                             "head_dim and is_causal, as transformers' attention classes have); "
                             "set cp: 1")
        return marked

    @staticmethod
    def _eager_of(module: nn.Module):
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"topology.cp: {type(module).__name__}'s module has no "
                             "eager_attention_forward; load the model with attn_implementation="
                             "'sdpa', or set cp: 1")
        return fn

    def release(self) -> None:
        """At close: the model's own attention again (its group is gone with the job)."""
        self.config._attn_implementation = self.inner

    @contextmanager
    def plain(self):
        """The model's own attention over whole sequences (generation: every rank of the group
        runs the same rows whole)."""
        self.config._attn_implementation = self.inner
        try:
            yield
        finally:
            self.config._attn_implementation = NAME

    # ---- the batch ----
    def shard(self, batch: dict) -> dict:
        """This rank's tokens of one micro-batch on the device: input ids, pre-shifted labels and
        global positions cut to its slice; the attention mask made whole, at full length, for the
        attention of every layer. A row not divisible by cp is padded at its end with tokens that
        are no target and that no real token attends to (causal): the same loss and gradients."""
        if not isinstance(batch, dict) or "input_ids" not in batch:
            raise ValueError("topology.cp: a batch is a dict with input_ids (context parallelism "
                             "splits the token sequence); inputs_embeds are not split")
        ids = batch["input_ids"]
        rows, length = ids.shape
        other = [k for k, v in batch.items() if k not in SEQUENCE_KEYS and torch.is_tensor(v)
                 and v.dim() >= 2 and v.shape[1] == length]
        if other:
            raise ValueError(f"topology.cp: batch keys {other} have the sequence's length "
                             f"{length} and polyshard does not know how to split them; drop them "
                             "or set cp: 1")
        mask = batch.get("attention_mask")
        pad = -length % self.cp
        if pad and mask is not None and mask.dim() == 4:
            raise ValueError(f"topology.cp {self.cp}: rows of {length} tokens with a 4-D "
                             f"attention mask (packed rows) must divide by cp; pack_to a "
                             f"multiple of {self.cp}")
        positions = batch.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=ids.device).expand(rows, length)
        shift = batch.get("shift_labels")
        if shift is None and batch.get("labels") is not None:
            shift = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        # the tokens that are not padding, the ones cp pads with included (the router's
        # balancing loss counts them; router.py)
        real = mask if mask is not None and mask.dim() == 2 else None
        if pad:
            real = F.pad(torch.ones_like(ids) if real is None else real, (0, pad), value=0)
            self._say_padded(length)
            ids = F.pad(ids, (0, pad))
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(
                1, pad + 1, device=ids.device)], dim=1)
            shift = None if shift is None else F.pad(shift, (0, pad), value=IGNORE_INDEX)
            mask = None if mask is None else F.pad(mask, (0, pad), value=1)
        if mask is not None and mask.dim() == 2:
            mask = self._full_mask(ids, mask, positions)
        part = slice(self.rank * (ids.shape[1] // self.cp), (self.rank + 1) * (ids.shape[1] // self.cp))
        out = {k: v for k, v in batch.items() if k not in SEQUENCE_KEYS}
        # contiguous: the loss views its targets flat
        out.update(input_ids=ids[:, part].contiguous(), position_ids=positions[:, part].contiguous())
        if shift is not None:  # labels too: the model computes its loss only when given labels
            mine = shift[:, part].contiguous()
            out.update(labels=mine, shift_labels=mine)
        if mask is not None:
            out["attention_mask"] = mask
        self.real_tokens = None if real is None else real[:, part]
        return out

    def _full_mask(self, ids, mask, positions):
        from transformers.masking_utils import create_causal_mask

        length = ids.shape[1]
        # transformers 5's signature: (config, inputs_embeds, attention_mask, cache, position_ids)
        return create_causal_mask(self.mask_config, ids.new_empty((ids.shape[0], length, 0),
                                                                  dtype=torch.float32),
                                  mask, None, position_ids=positions)

    def _say_padded(self, length: int) -> None:
        if not self.padded:
            self.padded = True
            self.say(f"topology.cp {self.cp}: rows of {length} tokens are padded to "
                     f"{length + (-length % self.cp)} for the split (padding is no target and "
                     "no real token attends to it: the same loss and gradients)")

    # ---- attention ----
    def attend(self, module, query, key, value, attention_mask, **kwargs):
        group, repeat = self.group, self.kv_repeat
        if repeat > 1:  # fewer key/value heads than cp splits: each repeated (kv_repeat)
            key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        # sequence split -> head split: each rank attends over every token with 1/cp of the heads
        q, k, v = (_AllToAll.apply(t, group, 1, 2) for t in (query, key, value))
        if self.inner == "eager":
            fn, attention_mask = module._polyshard_eager, _additive(attention_mask, q)
        else:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as fn
        groups = getattr(module, "num_key_value_groups", None)
        if repeat > 1:  # the attention repeats keys for its query heads by the module's ratio
            module.num_key_value_groups = groups // repeat
        try:
            out, _ = fn(module, q, k, v, attention_mask, **kwargs)  # (B, tokens, heads / cp, D)
        finally:
            if repeat > 1:
                module.num_key_value_groups = groups
        # and back: this rank's tokens, every head
        return _AllToAll.apply(out, group, 1, 2), None


def _additive(mask, query):
    """eager's mask: additive in the compute dtype; causal where the batch had none."""
    if mask is not None and mask.dtype != torch.bool:
        return mask
    length = query.shape[2]
    if mask is None:
        mask = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()[None, None]
    low = torch.finfo(query.dtype).min
    return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, low)


def apply_context_parallel(model: nn.Module, cp: int, rank: int, tp: int, say) -> ContextParallel | None:
    """topology.cp above 1: the model's attention wrapped (before the backend wraps the model); the
    group is set once the backend has it (`ContextParallel.group`)."""
    return ContextParallel(model, cp, rank, tp, say) if cp > 1 else None
