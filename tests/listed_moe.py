"""A transformers 5 mixture-of-experts model with its experts as a ModuleList: the layout of an MoE
of one's own (and of transformers 4.57), which topology.ep and the unused-expert rule split and
drop per expert (parallel/engine/model/moe/). transformers 5 fuses a block's experts into 3-D
tensors (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F]); `listed(model)` puts
each expert's rows of them in a module of its own, called as the fused module is (hidden states,
top-k indices, top-k weights) by the model's own block: the same numbers, one module per expert."""

from __future__ import annotations

import torch
from torch import nn


class Expert(nn.Module):
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act):
        super().__init__()
        self.gate_up = nn.Linear(gate_up.shape[1], gate_up.shape[0], bias=False)
        self.down = nn.Linear(down.shape[1], down.shape[0], bias=False)
        with torch.no_grad():
            self.gate_up.weight.copy_(gate_up)
            self.down.weight.copy_(down)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class ListedExperts(nn.ModuleList):
    """The fused module's loop (transformers 5's MixtralExperts.forward), one module per expert."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for index in hit:
            index = int(index[0])
            if index == len(self):
                continue
            slot, token = torch.where(mask[index])
            rows = self[index](hidden_states[token]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, rows.to(out.dtype))
        return out


def listed(model: nn.Module) -> nn.Module:
    """`model` with every fused experts module replaced by a ListedExperts of the same weights."""
    for module in list(model.modules()):
        fused = getattr(module, "experts", None)
        if isinstance(fused, nn.Module) and getattr(fused, "gate_up_proj", None) is not None:
            module.experts = ListedExperts(
                Expert(fused.gate_up_proj[e].detach(), fused.down_proj[e].detach(), fused.act_fn)
                for e in range(fused.gate_up_proj.shape[0]))
    return model
