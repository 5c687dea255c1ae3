"""The Muon recipe as large runs use it (Moonlight, Kimi K2): `torch.optim.Muon` on the hidden
matrices, AdamW on the rest (embeddings, the head, norms, biases), two optimizers in one job:

    engine.prepare(model, optimizer=muon_with_adamw(muon={"lr": 2e-2}, adamw={"lr": 3e-4}),
                   param_groups=hidden_matrices())

`hidden_matrices` is a `param_groups` hook: it sees every parameter as built (full shapes, on every
backend) and marks each group `use_muon` (the key DeepSpeed's and Moonlight's Muon groups use);
`muon_with_adamw` builds one optimizer per kind over the sharded parameters of those groups."""

from __future__ import annotations

from collections.abc import Callable

import torch

# Names of 2-D parameters that are not hidden matrices in the models people train: token and
# position embeddings (Llama's embed_tokens, GPT-2's wte / wpe, T5's shared), the head (lm_head, a
# classifier's classifier / score)
NOT_HIDDEN = ("embed", "lm_head", "wte", "wpe", "shared", "classifier", "score")


def hidden_matrices(exclude: tuple[str, ...] = NOT_HIDDEN) -> Callable:
    """A `param_groups` hook: group 0 the 2-D parameters whose names hold none of `exclude`
    (`use_muon: True`), group 1 the rest (`use_muon: False`); an empty group is left out."""
    def hook(named):
        muon = [n for n, p in named if p.ndim == 2 and not any(x in n for x in exclude)]
        chosen = set(muon)
        groups = [{"params": muon, "use_muon": True},
                  {"params": [n for n, _ in named if n not in chosen], "use_muon": False}]
        return [g for g in groups if g["params"]]
    return hook


def muon_with_adamw(muon: dict | None = None, adamw: dict | None = None) -> Callable:
    """An optimizer factory: torch.optim.Muon(`muon` kwargs) over the groups marked use_muon,
    AdamW(`adamw` kwargs) over the others; with `prepare(param_groups=hidden_matrices())`."""
    def build(groups):
        if not groups or not isinstance(groups[0], dict) or any("use_muon" not in g
                                                                for g in groups):
            raise ValueError("optimizer: muon_with_adamw needs groups marked use_muon; pass "
                             "prepare(param_groups=hidden_matrices()) or your own hook marking "
                             "each group use_muon: true / false")
        out = []
        for cls, kwargs, use in ((torch.optim.Muon, muon, True),
                                 (torch.optim.AdamW, adamw, False)):
            mine = [g for g in groups if g["use_muon"] is use]
            if mine:
                out.append(cls(mine, **(kwargs or {})))
        return out
    return build
