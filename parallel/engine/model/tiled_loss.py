"""`sequence.loss_tile`: a causal LM's loss computed a tile of tokens at a time, so the logits (tokens x
vocabulary: 16 GiB in fp32 at 32k tokens and a 128k vocabulary) are never held whole.

The lm_head module itself computes the loss: its `forward` (patched on the instance, so parameter
names, shard units and every backend's hooks stay as they are) takes the batch's labels from the
engine, and returns the mean cross-entropy over the shifted targets, each tile's logits computed,
reduced and freed, and recomputed in backward (`_Tile`). The loss is the
module's output, so FSDP's and ZeRO-3's backward hooks gather its weight before the recompute. The
model returns that loss as its `logits`; a model that transforms its logits after lm_head (Gemma's
softcapping, a logit scale) would change it, so the first forward checks it came back unchanged and
refuses otherwise, and hands back outputs without logits. Without labels (generation, a forward of
your own) lm_head is itself, and evaluate() with metrics that read logits runs the model's own loss.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from parallel.kits.objective import IGNORE_INDEX, base_model, count_shifted, label_count


def _tile_sum(hidden: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()  # as Hugging Face's loss upcasts them
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


class _Tile(torch.autograd.Function):
    """One tile's summed cross-entropy: forward keeps its inputs, not its logits; backward computes
    them again under the forward's autocast and differentiates. torch.utils.checkpoint would do the
    same, but it looks up a device module (`torch.xla` does not exist: measured, XLA's tensors fail
    there), so this works on every device."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets):
        kind = hidden.device.type
        ctx.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        ctx.save_for_backward(hidden, weight, bias, targets)
        with torch.no_grad():
            return _tile_sum(hidden, weight, bias, targets)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets = ctx.saved_tensors
        kind, enabled, dtype = ctx.autocast
        wanted = [t.detach().requires_grad_(need) if t is not None else None
                  for t, need in zip((hidden, weight, bias), ctx.needs_input_grad)]
        with torch.enable_grad(), torch.autocast(kind, dtype=dtype, enabled=enabled):
            loss = _tile_sum(*wanted, targets)
        inputs = [t for t in wanted if t is not None and t.requires_grad]
        found = iter(torch.autograd.grad(loss, inputs, grad))
        return (*(next(found) if t is not None and t.requires_grad else None for t in wanted),
                None)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN included: a rank without targets (0/0, as the model's own mean gives;
    topology.cp's last slice of a padded row) must pass the check as every other rank does, or it
    alone would raise and leave the others waiting in the next collective (measured: a hang)."""
    return torch.equal(a, b) or bool(a.isnan() & b.isnan())


class TiledLoss:
    """Owns the patched lm_head: `forward(model, batch)` is the engine's forward with the loss tiled."""

    def __init__(self, head: nn.Module, tile: int, model_name: str):
        self.head, self.tile, self.model_name = head, tile, model_name
        self.labels: tuple[torch.Tensor, bool] | None = None  # (targets, already shifted)
        self.loss: torch.Tensor | None = None
        self.checked = False  # the model returned lm_head's loss unchanged (the first forward)
        original = head.forward

        def forward(module, hidden):
            if self.labels is None:
                return original(hidden)
            self.loss = self._loss(module, hidden, self.labels)
            return self.loss

        head.forward = types.MethodType(forward, head)

    def _loss(self, head: nn.Module, hidden: torch.Tensor, labels) -> torch.Tensor:
        labels, shifted = labels
        if not shifted:  # position t predicts label t + 1
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        hidden = hidden.reshape(-1, hidden.shape[-1])
        targets = labels.reshape(-1).to(hidden.device)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, targets.numel(), self.tile):
            end = start + self.tile
            total = total + _Tile.apply(hidden[start:end], head.weight, head.bias,
                                        targets[start:end])
        return total / (targets != IGNORE_INDEX).sum()  # the model's own mean (0/0 with none)

    def forward(self, model: nn.Module, batch: dict):
        """(outputs, loss) as the model's own forward with labels gives them."""
        if not isinstance(batch, dict) or "labels" not in batch:
            outputs = model(**batch)
            return outputs, outputs.loss
        # shift_labels (topology.cp: shifted before the split) are the targets as they are
        shifted = batch.get("shift_labels") is not None
        self.labels = (batch["shift_labels"], True) if shifted else (batch["labels"], False)
        try:
            outputs = model(**{k: v for k, v in batch.items()
                               if k not in ("labels", "shift_labels")})
        finally:
            self.labels = None
        mine, self.loss = self.loss, None
        # What the model hands back is lm_head's output as the backend's hooks left it (ZeRO-3
        # wraps a module's outputs in its backward hook's function: another tensor, the same
        # value), and backward must go through it. It must be the loss unchanged: a model that
        # scales or softcaps its logits after lm_head would change it, so the first forward
        # compares the two (one host read, once).
        loss = outputs.logits
        if mine is None or loss is None or loss.dim() != 0 or (
                not self.checked and not _same(loss.detach(), mine.detach())):
            raise RuntimeError(f"sequence.loss_tile: {self.model_name} changes its logits after "
                               "lm_head (softcapping or scaling), so the tiled loss would be "
                               "changed too; unset sequence.loss_tile for this model")
        self.checked = True
        # what the model returned as logits is the loss: outputs without it (as attribute, key and
        # tuple item alike)
        outputs = type(outputs)(**{k: v for k, v in outputs.items() if k != "logits"})
        aux = getattr(outputs, "aux_loss", None)  # a mixture of experts' router loss, as HF adds it
        if aux is not None:
            loss = loss + getattr(base_model(model).config, "router_aux_loss_coef", 0.0) * aux.to(loss.device)
        return outputs, loss


def apply_tiled_loss(model: nn.Module, tile: int | None, has_loss_fn: bool) -> TiledLoss | None:
    """Patch the model's lm_head to compute a tiled loss (before the backend wraps the model)."""
    if tile is None:
        return None
    base = base_model(model)
    name = type(base).__name__
    if has_loss_fn:
        raise ValueError("sequence.loss_tile: the engine was given a loss_fn, which computes the "
                         "loss itself; unset sequence.loss_tile, or tile the loss in your loss_fn")
    if label_count(model) is not count_shifted:
        raise ValueError(f"sequence.loss_tile: {name} is not a causal LM (the tiled loss is a "
                         "causal LM's shifted cross-entropy); unset sequence.loss_tile")
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    config = getattr(base, "config", None)
    cap = getattr(config, "final_logit_softcapping", None)
    if not isinstance(head, nn.Linear) or cap is not None:
        why = (f"its logits are softcapped (final_logit_softcapping {cap})" if cap is not None
               else f"its output layer is {type(head).__name__}, not a Linear")
        raise ValueError(f"sequence.loss_tile: {name}: {why}; unset sequence.loss_tile")
    return TiledLoss(head, tile, name)
