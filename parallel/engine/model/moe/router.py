"""A mixture-of-experts model's load-balancing loss over the global batch (`moe.router_loss: global`).

Hugging Face's MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) add, with
`output_router_logits: true`, `router_aux_loss_coef x load_balancing_loss_func(...)` to their loss
(Switch Transformer's equations 4-6): E x sum over (k, e) of f[k, e] x P[e], where f is the fraction
of tokens whose k-th choice is expert e and P[e] the mean router probability of e, both over every
token of the batch and every MoE layer (padding left out by a 2-D attention mask). The loss is a
product of two means, so it is not linear in the batch: computed per rank, as the model does when
each rank runs it, the mean of the ranks' losses is not one process's (measured: Qwen2-MoE 1.2e-3
off one process at 2 ranks, exit 0).

Here the model runs with `output_router_logits=False` (its loss is the language-model loss alone,
weighed by objective.py like any other), the router's logits are kept by a forward hook on each
block's `gate`, and the balancing loss is added from them: the counts (f's numerators, no gradient)
and the token count are summed over the ranks that hold other tokens of the micro-batch (data
parallel x cp) in one all_reduce of k x E + 1 numbers, and each rank adds
E x sum f_global[k, e] x P_local[e] / N_global, P_local's sum over its own tokens, whose sum over
ranks is the global loss and whose gradient is exactly its share. Times the data-parallel degree,
as objective.py's shares, because every backend's gradient reduction averages over those ranks.

Transformers' Qwen2-MoE and OLMoE functions slice f by the CUDA device's index, so on cuda:1 their
per-rank loss is zero (read in transformers 4.57.1's load_balancing_loss_func); the loss here
follows Mixtral's function, which is what every one of them computes on cuda:0 or the CPU.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from parallel.dist import PendingSum


class RouterLoss:
    """The router logits of one forward, and the balancing loss made from them."""

    def __init__(self, gates: list[nn.Module], top_k: int, coef: float, data_parallel: int):
        self.top_k, self.coef, self.data_parallel = top_k, coef, data_parallel
        self.kept: list[torch.Tensor] = []  # the last training forward's logits, layer by layer
        self._logits: list[torch.Tensor] | None = None
        self._handles = [g.register_forward_hook(self._keep) for g in gates]

    @classmethod
    def for_model(cls, model: nn.Module, blocks: list, scope: str, data_parallel: int,
                  has_loss_fn: bool) -> RouterLoss | None:
        """For a model whose config asks for the router's loss, unless moe.router_loss is rank or
        a loss_fn computes the loss (then the model's own, per rank)."""
        from parallel.kits.objective import base_model

        config = getattr(base_model(model), "config", None)
        if not getattr(config, "output_router_logits", False) or scope == "rank" or has_loss_fn:
            return None
        gates = [getattr(block, "gate", None) for _, block in blocks]
        if not blocks or not all(isinstance(g, nn.Module) for g in gates):
            raise ValueError(
                f"{type(base_model(model)).__name__}: config.output_router_logits is true, and "
                "polyshard finds no router (a `gate` module beside each block's `experts`) to "
                "compute its load-balancing loss over the global batch; set moe.router_loss: rank "
                "(each rank's own, as the model computes it) or output_router_logits: false")
        return cls(gates, config.num_experts_per_tok, float(config.router_aux_loss_coef),
                   data_parallel)

    def _keep(self, module, args, output) -> None:
        if self._logits is not None:  # a training forward (not eval, generate or a recompute)
            self._logits.append(output[0] if isinstance(output, tuple) else output)

    @contextmanager
    def capture(self):
        self._logits = []
        try:
            yield
        finally:
            self.kept, self._logits = self._logits, None

    def share(self, tokens: torch.Tensor | None, parts: int, group) -> torch.Tensor:
        """This rank's part of the step's balancing loss for the micro-batch just run; `tokens`:
        1 for each of its real tokens (a 2-D attention mask, cp's slice of it), None: all are;
        `group`: the ranks holding the micro-batch's other tokens (data parallel x cp)."""
        logits, self.kept = torch.cat(self.kept), []
        counts, n, probs = statistics(logits, self.top_k, tokens)
        both = PendingSum(torch.cat([counts.flatten(), n.reshape(1)]), group)()
        counts, n = both[:-1].view_as(counts), both[-1].clamp(min=1)
        return balancing_loss(counts, n, probs) * (self.coef * self.data_parallel / parts)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def statistics(logits: torch.Tensor, top_k: int, tokens: torch.Tensor | None):
    """Over this rank's tokens of every layer: (tokens whose k-th choice is each expert [k, E], no
    gradient; tokens counted, a scalar; router probabilities summed per expert [E])."""
    probs = torch.softmax(logits, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices  # [rows, k]
    if tokens is None:
        weight = torch.ones(probs.shape[0], device=probs.device, dtype=probs.dtype)
    else:  # the layers' logits are concatenated, each over the micro-batch's tokens in order
        flat = tokens.reshape(-1).to(probs.dtype)
        if probs.shape[0] % flat.numel():
            raise ValueError(f"moe.router_loss: {probs.shape[0]} router rows for a mask of "
                             f"{flat.numel()} tokens")
        weight = flat.repeat(probs.shape[0] // flat.numel())
    # counted by index, not through Hugging Face's one-hot [rows, k, E] (at 64 experts, top-8,
    # 48 layers of 32k tokens: 3.2 GB of floats for k x E numbers)
    counts = torch.zeros(top_k, probs.shape[-1], device=probs.device, dtype=probs.dtype)
    counts.scatter_add_(1, chosen.T, weight.detach().expand(top_k, -1))
    return counts, weight.sum().detach(), (probs * weight[:, None]).sum(0)


def balancing_loss(counts: torch.Tensor, n: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """E x sum over (k, e) of (counts / n) x (probs / n): Hugging Face's load_balancing_loss_func
    when counts, n and probs are over the whole batch."""
    return probs.shape[-1] * (counts / n * (probs / n)[None, :]).sum()
