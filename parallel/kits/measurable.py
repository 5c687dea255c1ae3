"""What `polyshard bench` and `polyshard parity` need from an engine beyond training: the tensors a
rank holds, and the whole model. Backends' engines implement it (ModuleStateTensors gives the default
for engines whose model and optimizer hold what the rank holds); the base Engine does not need it."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Measurable(Protocol):
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds for the model: params, grads, optimizer (lists of tensors)."""

    def gather_model(self) -> dict[str, torch.Tensor]:
        """Whole weights on CPU, keyed by the original parameter names (tied weights under each
        name), on every rank. Collective; for inspection and parity checks of models that fit."""


def measurable(engine, tool: str) -> Measurable:
    if not isinstance(engine, Measurable):
        raise TypeError(f"{tool} needs state_tensors() and gather_model() from the engine, which "
                        f"backend {engine.spec.backend!r} does not provide")
    return engine


class ModuleStateTensors:
    """state_tensors() for engines whose `model` and `optimizer` hold exactly this rank's tensors."""

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.model.parameters())
        return {"params": params, "grads": [p.grad for p in params],
                "optimizer": [v for st in self.optimizer.state.values() for v in st.values()
                              if isinstance(v, torch.Tensor) and v.dim() > 0]}
