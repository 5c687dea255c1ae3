"""topology.pp applied to a model before sharding: this rank's stages (the parts the schedule runs) and
one module over all of them under the model's own names (what checkpoints, the optimizer's groups and
the engine's `model` see), with everything refused that would not give one process's numbers."""

from __future__ import annotations

import copy

from torch import nn

from parallel.engine.model.pipeline import stages as st
from parallel.kits.names import clean_name
from parallel.kits.objective import Objective, count_shifted
from parallel.engine.model.pipeline.schedule import Pipeline, PipelineLayout, stage_ids
from parallel.spec.errors import SpecError


def check_pipelined(model: nn.Module, tied: list[list[str]], objective: Objective,
                    has_loss_fn: bool, router, split_points: list[str] | None = None,
                    say=print, experts_shared: str | None = None) -> None:
    """What topology.pp cannot run exactly, refused at prepare naming the fix. A model of your own
    (split at `split_points`) trains its last stage's logits on `labels` with the causal-LM loss,
    counted over the step as a Hugging Face causal LM's is (said at prepare). `experts_shared`: the
    multi-stage schedule a mixture-of-experts model would run with its blocks sharded over data
    parallel ranks, if so."""
    if has_loss_fn:
        raise SpecError([("topology.pp", "with a loss_fn: the last stage computes the loss from "
                          "the logits with the model's own loss function; pass a Hugging Face "
                          "causal LM and batches with labels, or topology.pp: 1")])
    family = st.family_of(model, split_points)
    if family.own and objective.count is None:
        objective.count = count_shifted
        say("topology.pp: a model of your own; its last stage's logits take the causal-LM loss "
            "on `labels` (shifted, -100 ignored, a mean over the step's targets)")
    if objective.count is not count_shifted:
        raise SpecError([("topology.pp", f"{type(model).__name__}: pipelined steps take a causal "
                          "LM's labels loss (a mean over target tokens); use topology.pp: 1")])
    both = set(family.first) | set(family.last)
    for group in tied:
        if any(n.rpartition(".")[0] in both for n in group):
            raise SpecError([("topology.pp", f"tied weights {group}: the first stage's embeddings "
                              "and the last stage's head are one tensor on different ranks; "
                              "build the model with tie_word_embeddings=False (untied copies, "
                              "then trained apart), or use topology.pp: 1")])
    if router is not None:
        raise SpecError([("topology.pp", "a mixture-of-experts router's balancing loss is one "
                          "function of every layer's router logits, which stages hold apart; use "
                          "topology.pp: 1, or build the model with output_router_logits=False")])
    if experts_shared is not None:
        raise SpecError([("pipeline.schedule", f"{experts_shared!r} with a mixture-of-experts model "
                          "sharded over data-parallel ranks: torch 2.9's multi-stage schedules "
                          "reduce a block's experts before some of their gradients exist on some "
                          "ranks (measured on Mixtral at pp 2 x dp 2, at ep 1 and 2: a collective "
                          "mismatch); use 1f1b or gpipe (docs/moe.md)")])


def merged_view(parts: list[nn.Module], family: st.Family) -> nn.Module:
    """One module holding this rank's stages' modules (shared, not copied) under the model's names:
    the union of their layers, the embeddings where the first stage is here, norm and head where the
    last is. Made before sharding: the shards fully_shard puts in the shared modules are its own."""
    if len(parts) == 1:
        return parts[0]
    view = _shell(parts[-1], family.layers)
    parent, name = st._parent(view, family.layers)
    layers = {}
    for part in parts:
        layers.update(part.get_submodule(family.layers)._modules)
    setattr(parent, name, st.StageLayers(dict(sorted(layers.items(), key=lambda kv: int(kv[0])))))
    for path in family.first + family.last + ((family.zero_positions,) if family.zero_positions
                                               else ()) + family.once:
        found = [p.get_submodule(path) for p in parts if _real(p, path)]
        setattr(*st._parent(view, path), found[0] if found else None)
    return view


def _real(part: nn.Module, path: str) -> bool:
    return st.has_module(part, path) and not isinstance(part.get_submodule(path),
                                                         (nn.Identity, st.ZeroPositions))


def _shell(model: nn.Module, layers: str) -> nn.Module:
    """A shallow copy of `model` and of each module on the path to its layers, with their own
    registries (so that what is set on the copy is not set on the model)."""
    view = node = copy.copy(model)
    for name in [*layers.split(".")[:-1], None]:  # None: the layers' owner, the path's end
        node._modules = dict(node._modules)
        node._parameters, node._buffers = dict(node._parameters), dict(node._buffers)
        if name is not None:
            node._modules[name] = node = copy.copy(node._modules[name])
    view.__dict__.pop("forward", None)  # the stage's forward is the part's, not the view's
    return view


def apply_pipeline(model: nn.Module, spec, pp_rank: int, group, device, forward_kwargs: dict,
                   runner: type[Pipeline] = Pipeline) -> tuple[nn.Module, Pipeline]:
    """(the view over this rank's stages of `model`, the `runner` that runs them)."""
    p, pp = spec.pipeline, spec.topology.pp
    ids = stage_ids(p.schedule, pp_rank, pp, p.stages_per_rank)
    n_stages = pp * p.stages_per_rank
    whole = {clean_name(n) for n in model.state_dict()}
    parts = st.split(model, ids, n_stages, p.split_points, forward_kwargs)
    view = merged_view(parts, st.family_of(model, p.split_points))
    layout = PipelineLayout(p.schedule, p.microbatches or spec.micro_batch_size, ids, n_stages, pp,
                            group, spec.dims.dp_cp)
    pipeline = runner(parts, layout, device)
    pipeline.elsewhere = frozenset(whole - {clean_name(n) for n in view.state_dict()})
    return view, pipeline
