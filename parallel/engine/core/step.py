"""What a training step is made of, apart from the Engine that runs it: what it returns, how an
optimizer is built, how gradients are measured and clipped (the batch side:
parallel/engine/data/batches.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

OptimizerArg = Callable[..., torch.optim.Optimizer] | tuple[type, dict[str, Any]]
LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class StepResult:
    """What one optimizer step did. `loss` is the mean over ranks, as a single process would
    compute it: with on_nonfinite raise|skip the step already read it (no second read); with
    raise_deferred it is read from the device when first asked. `grad_norm` is read when asked."""

    step: int
    loss_tensor: torch.Tensor
    grad_norm_tensor: torch.Tensor | None
    lr: float
    tokens: int
    step_time: float
    stepped: bool = True  # False when the update was skipped (fp16 loss scaling; on_nonfinite: skip)
    loss_value: float | None = None  # the host copy, once read
    # items the step's loss averaged over, all ranks (target tokens of a labelled HF batch); None
    # where every micro-batch weighs alike
    targets_tensor: torch.Tensor | None = None
    # at a logging step, more metrics for the trackers as (names, one device tensor, unread):
    # topology.ep's expert loads
    metrics: tuple[list[str], torch.Tensor] | None = None

    @property
    def loss(self) -> float:
        if self.loss_value is None:
            self.loss_value = float(self.loss_tensor)
        return self.loss_value

    @property
    def targets(self) -> int | None:
        return None if self.targets_tensor is None else int(self.targets_tensor)

    @property
    def grad_norm(self) -> float | None:
        return None if self.grad_norm_tensor is None else float(self.grad_norm_tensor)


FROZEN = ("a model without trainable parameters (a frozen reference or teacher) has no place of "
          "its own in an engine yet (issue #84: several models per engine); train one model per "
          "engine and hold the frozen one beside it (built on each rank, or in a module with the "
          "trained one, its parameters requires_grad=False)")


class PrepareError(ValueError):
    """What `prepare` was handed cannot be trained as given (the CLI and launch say it plainly)."""


def build_optimizer(optimizer: OptimizerArg, params) -> torch.optim.Optimizer:
    """Optimizers are built after sharding (they must see the sharded parameters)."""
    try:
        if isinstance(optimizer, tuple):
            cls, kwargs = optimizer
            return cls(params, **kwargs)
        return optimizer(params)
    except ValueError as err:
        if "empty parameter list" not in str(err):
            raise
        raise PrepareError(
            "optimizer: it was built over no parameter (torch: 'optimizer got an empty parameter "
            "list'). A factory that picks parameters from the model by shape (p.dim() == 2) "
            "finds none where the backend shards flat (FSDP1, XLA FSDP v1: after sharding each "
            "parameter is a 1-D view). Pick them by their shapes as built: prepare(..., "
            "param_groups=hidden_matrices()) with muon_with_adamw() (docs/optimizers.md), or "
            "build the optimizer over the parameters the factory is handed") from None


def check_built(model: nn.Module) -> None:
    """The model as built, before sharding: fp32 (every precision keeps fp32 master weights; a
    model loaded in 16 bits would silently not) and something to train."""
    bad = sorted({str(p.dtype) for p in model.parameters()
                  if p.dtype != torch.float32 and p.device.type != "meta"})
    if bad:
        raise PrepareError(f"model: parameters are {bad}; every precision keeps fp32 master "
                           "weights, so pass an fp32 model (torch_dtype=torch.float32) and set "
                           "`precision: bf16` for bf16 compute")
    if not any(p.requires_grad for p in model.parameters()):
        raise PrepareError(f"model: no parameter requires grad: {FROZEN}")


def require_optimizer(optimizer) -> None:
    if optimizer is None:
        raise PrepareError(f"prepare(model, optimizer=None): {FROZEN}; pass an optimizer, e.g. "
                           "optimizer=(torch.optim.AdamW, {'lr': 1e-4})")


def clip_grad_norm(params, max_norm: float | None, stages=None, experts=None) -> torch.Tensor:
    """The global gradient 2-norm of `params`, clipped to `max_norm` when set. DTensor gradients
    (FSDP2) give partial norms per shard: reduced to the full norm before clipping. Gradients on
    several meshes (TP + FSDP2: the split projections on (dp_shard, tp), the rest on dp_shard)
    are normed per mesh and the squares summed: torch stacks per-tensor norms, which DTensor
    refuses across meshes (measured: "All operands in aten.stack.default must have the same
    mesh"), so each mesh costs one reduction. `stages`: topology.pp's group, whose ranks hold the
    other layers: the squares summed over it too (torchtitan's one extra reduction under pp).
    `experts`: topology.ep's part (ExpertParallel): the squares of its parameters' gradients (each
    rank holds other experts) summed over its ep group, one more reduction, on every rank alike
    (a rank whose experts got no gradient adds a zero)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    held = experts.param_ids if experts is not None else frozenset()
    groups: dict = {}
    own: list = []
    for p in params:
        if p.grad is not None:
            if id(p) in held:
                own.append(p)
                continue
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p)
    norms = [_norm(members) for members in groups.values() or [[]]]
    if experts is not None:  # after the dense meshes' reductions, on every rank in this order
        square = (_norm(own).float() ** 2).to(norms[0].device) if own else \
            torch.zeros((), device=norms[0].device)
        dist.all_reduce(square, group=experts.group)
        norms.append(square.sqrt())
    norm = norms[0] if len(norms) == 1 else torch.stack([n.float() ** 2 for n in norms]).sum().sqrt()
    if stages is not None:
        square = norm.float() ** 2
        dist.all_reduce(square, group=stages)
        norm = square.sqrt()
    if max_norm is not None:
        for members in [*groups.values(), own]:
            torch.nn.utils.clip_grads_with_norm_(members, max_norm, norm)
    return norm


def _norm(members: list) -> torch.Tensor:
    """The 2-norm of the gradients of `members` (one mesh), reduced over its shards."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm([p.grad for p in members], 2.0, False)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
