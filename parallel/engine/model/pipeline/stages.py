"""A Hugging Face decoder split into pipeline stages that keep its parameter names and its own forward.

Each stage is the model itself, pruned: the decoder layers it does not run are removed (the ones it
keeps stay under their original indices, `model.layers.5.mlp...`, so checkpoints, optimizer groups
and `save_pretrained` read the names one process has), the embeddings stay on the first stage only and
the final norm and head on the last only (elsewhere an identity). Every stage runs the model's own
`forward` with `inputs_embeds` = the activations it received, so rotary embeddings, position ids and the
causal / padding mask are made on each stage exactly as the whole model makes them (torchtitan's model
does the same by hand; here nothing of the model is rewritten).

The families this knows (`FAMILIES`): Llama, Qwen2, Mistral, Mixtral, Qwen2-MoE, Qwen3-MoE (a
`model.layers` decoder with `embed_tokens`, `norm` and `lm_head`) and GPT-2 (`transformer.h`,
`wte`/`wpe`, `ln_f`).

A model of your own splits where `pipeline.split_points` names its layers (`layers.4`: items of one
ModuleList or ModuleDict), torchtitan's contract for its own models: what is registered before the
layers runs on the first stage, what after on the last, each in its registration order; elsewhere it
is an identity, so a forward written `h = embed(x); for layer in layers: h = layer(h); return
head(norm(h))` runs any stage unchanged, taking activations where the first stage takes ids.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass

import torch
from torch import nn

from parallel.spec.errors import SpecError


@dataclass(frozen=True)
class Family:
    layers: str  # the decoder layers' ModuleList
    first: tuple[str, ...]  # modules only the first stage runs (removed elsewhere)
    last: tuple[str, ...]  # modules only the last stage runs (an identity elsewhere)
    zero_positions: str | None = None  # a learned position table the first stage adds (GPT-2)
    once: tuple[str, ...] = ()  # what the first stage applies once (GPT-2's embedding dropout)
    own: bool = False  # a model of your own: its forward as written, absent modules an identity


LLAMA = Family("model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"))
FAMILIES = {
    **dict.fromkeys(("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM",
                     "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"), LLAMA),
    "GPT2LMHeadModel": Family("transformer.h", ("transformer.wte",), ("transformer.ln_f", "lm_head"),
                              zero_positions="transformer.wpe", once=("transformer.drop",)),
}


class StageLayers(nn.ModuleDict):
    """The decoder layers one stage runs, under their original indices. The model's own loop reads
    it as its ModuleList (`self.layers[:n]`, `for block in self.h`): iterating and slicing give the
    layers in order."""

    def __getitem__(self, key):
        if isinstance(key, (slice, int)):  # by position, as a ModuleList
            return list(self._modules.values())[key]
        return super().__getitem__(key)  # by original index, as named

    def __iter__(self):
        return iter(self._modules.values())


class ZeroPositions(nn.Module):
    """A later stage's stand-in for a learned position table the first stage already added."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.width, device=ids.device)


def family_of(model: nn.Module, split_points: list[str] | None = None) -> Family:
    name = type(model).__name__
    if name in FAMILIES:
        return FAMILIES[name]
    if split_points is None:
        raise SpecError([("pipeline.split_points", f"not set, and {name} has no stage split "
                          f"polyshard knows (it splits {', '.join(sorted(FAMILIES))}); name the "
                          "layers where stages 2, 3, ... begin (e.g. `layers.4`, docs/pipeline.md "
                          "says what such a model's forward does), or use topology.pp: 1")])
    return own_family(model, split_points)


def own_family(model: nn.Module, split_points: list[str]) -> Family:
    """A model of your own, split at `pipeline.split_points`: items of one ModuleList/ModuleDict."""
    path = split_points[0].rpartition(".")[0]
    container = model.get_submodule(path) if path and has_module(model, path) else None
    if not isinstance(container, (nn.ModuleList, nn.ModuleDict)) or any(
            n.rpartition(".")[0] != path for n in split_points):
        raise SpecError([("pipeline.split_points", f"{split_points} in {type(model).__name__}: "
                          "stages begin at items of one ModuleList or ModuleDict of the model "
                          "(e.g. `layers.4`), named as named_modules() names them")])
    first: list[str] = []
    last: list[str] = []
    node, prefix = model, ""
    for name in path.split("."):  # at each level: siblings before the layers' path, and after
        names = list(node._modules)
        at = names.index(name)
        first += [prefix + n for n in names[:at] if node._modules[n] is not None]
        last += [prefix + n for n in names[at + 1:] if node._modules[n] is not None]
        node, prefix = node._modules[name], f"{prefix}{name}."
    return Family(path, tuple(first), tuple(last), own=True)


def has_module(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def layer_bounds(n_layers: int, stages: int, split_points: list[str] | None,
                 layers_path: str) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers: contiguous and as even as possible (the first stages
    take one more where they do not divide), or where `pipeline.split_points` says stages begin."""
    if split_points is None:
        if n_layers < stages:
            raise SpecError([("topology.pp", f"{stages} stages for {n_layers} decoder layers: every "
                              "stage needs one; lower topology.pp or pipeline.virtual_stages")])
        size, extra = divmod(n_layers, stages)
        starts = [i * size + min(i, extra) for i in range(stages)]
    else:
        if len(split_points) != stages - 1:
            raise SpecError([("pipeline.split_points", f"{len(split_points)} names for {stages} "
                              f"stages: give the {stages - 1} layers where stages 2..{stages} begin")])
        starts = [0]
        for name in split_points:
            prefix, _, index = name.rpartition(".")
            if prefix != layers_path or not index.isdigit() or not \
                    starts[-1] < int(index) < n_layers:
                raise SpecError([("pipeline.split_points", f"{name!r} is not a layer after "
                                  f"{layers_path}.{starts[-1]} (the layers are {layers_path}.0 .. "
                                  f"{n_layers - 1}); name increasing layers, e.g. "
                                  f"{layers_path}.{max(1, n_layers // 2)}")])
            starts.append(int(index))
    return [(s, e) for s, e in zip(starts, starts[1:] + [n_layers])]


def _parent(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    owner, _, name = path.rpartition(".")
    return (model.get_submodule(owner) if owner else model), name


def make_stage(model: nn.Module, family: Family, bounds: tuple[int, int], first: bool, last: bool,
               forward_kwargs: dict) -> nn.Module:
    """`model` (a copy, or the model itself for the last use) pruned to one stage, its forward taking
    (input ids or activations, attention_mask, position_ids) and giving the activations, or on the
    last stage the logits."""
    parent, name = _parent(model, family.layers)
    layers = getattr(parent, name)
    setattr(parent, name, StageLayers(dict(list(layers._modules.items())[slice(*bounds)])))
    if not first:
        for path in family.first:
            setattr(*_parent(model, path), nn.Identity() if family.own else None)
        if family.zero_positions:
            table = model.get_submodule(family.zero_positions)
            setattr(*_parent(model, family.zero_positions), ZeroPositions(table.embedding_dim))
        for path in family.once:
            setattr(*_parent(model, path), nn.Identity())
    if not last:
        for path in family.last:
            setattr(*_parent(model, path), nn.Identity())
    own = type(model).forward

    def stage_forward(self, x, attention_mask=None, position_ids=None):
        given = {k: v for k, v in (("attention_mask", attention_mask),
                                   ("position_ids", position_ids)) if v is not None}
        if family.own:  # the model's forward as written (what a stage lacks is an identity)
            out = own(self, x, **given)
            out = getattr(out, "logits", out)
        else:
            embeds = {"inputs_embeds": x} if x.is_floating_point() else {"input_ids": x}
            out = own(self, **embeds, **given, **forward_kwargs).logits
        # the head's input is a slice of the hidden states (logits_to_keep), a view, which the
        # next stage's input-gradient pass (zbv, dualpipev) cannot detach in place (measured:
        # "Can't detach views in-place"); a stage that sends activations sends its own tensor
        return out if last or out._base is None else out.clone()

    model.forward = types.MethodType(stage_forward, model)
    return model


def split(model: nn.Module, stage_ids: list[int], n_stages: int, split_points: list[str] | None,
          forward_kwargs: dict) -> list[nn.Module]:
    """This rank's stages of `model`, one pruned copy each (the last one prunes `model` itself)."""
    family = family_of(model, split_points)
    n_layers = len(model.get_submodule(family.layers))
    bounds = layer_bounds(n_layers, n_stages, split_points, family.layers)
    out = []
    for k, s in enumerate(stage_ids):
        base = model if k == len(stage_ids) - 1 else copy.deepcopy(model)
        out.append(make_stage(base, family, bounds[s], s == 0, s == n_stages - 1, forward_kwargs))
    return out


def held_names(model: nn.Module, names: list[str], stage_ids: list[int], n_stages: int,
               split_points: list[str] | None) -> set[str]:
    """Which of `model`'s parameter `names` the stages `stage_ids` hold (as `split` prunes them;
    what `plan` and `dryrun` count per pipeline rank, without splitting anything)."""
    family = family_of(model, split_points)
    n_layers = len(model.get_submodule(family.layers))
    bounds = layer_bounds(n_layers, n_stages, split_points, family.layers)
    keys = list(model.get_submodule(family.layers)._modules)
    held = {f"{family.layers}.{keys[i]}." for s in stage_ids for i in range(*bounds[s])}
    ends = ((family.first + ((family.zero_positions,) if family.zero_positions else ())
             if 0 in stage_ids else ()) + (family.last if n_stages - 1 in stage_ids else ()))
    held.update(f"{path}." for path in ends)
    placed = (family.layers, *family.first, *family.last,
              *((family.zero_positions,) if family.zero_positions else ()))
    return {n for n in names if any(n.startswith(h) for h in held)
            or not any(n.startswith(f"{p}.") for p in placed)}
