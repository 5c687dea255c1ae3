"""Which modules become shard units: one plan, used by FSDP1, FSDP2, XLA FSDP and `polyshard explain`."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from parallel.spec.sections import Wrap
from parallel.spec.errors import SpecError


def plan_wrap(model: nn.Module, wrap: Wrap) -> list[tuple[str, nn.Module]]:
    """Units to wrap, children before parents (the order FSDP must wrap them in); the root excluded."""
    if wrap.policy == "none":
        return []
    if wrap.policy == "size":
        return _size_units(model, wrap.min_num_params)
    names = set(_auto_classes(model) if wrap.policy == "auto" else wrap.layer_classes)
    present = {type(m).__name__ for m in model.modules()}
    missing = sorted(names - present)
    if wrap.policy == "layer_classes" and missing:
        raise SpecError([("wrap.layer_classes", f"{missing} not found in {type(model).__name__}; "
                          f"candidates: {repeated_classes(model)}")])
    units = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in names]
    return list(reversed(units))  # named_modules is pre-order; reversed puts children first


def _auto_classes(model: nn.Module) -> list[str]:
    found = getattr(model, "_no_split_modules", None) or []
    if not found:
        raise SpecError([("wrap.policy", f"'auto' reads `_no_split_modules`, which "
                          f"{type(model).__name__} does not define; use `policy: layer_classes` "
                          f"with one of {repeated_classes(model)}, or `policy: size`")])
    return list(found)


def repeated_classes(model: nn.Module) -> list[str]:
    """Module classes that appear more than once with parameters: the usual shard-unit candidates."""
    counts = Counter(type(m).__name__ for m in model.modules() if any(True for _ in m.parameters()))
    return [name for name, n in counts.most_common() if n > 1] or [type(model).__name__]


def _size_units(model: nn.Module, min_num_params: int) -> list[tuple[str, nn.Module]]:
    """torch's size_based_auto_wrap_policy rule: wrap a module once the parameters it holds that no
    wrapped descendant already holds reach the threshold (counted bottom-up)."""
    units: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> int:
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            remaining += visit(f"{name}.{child_name}" if name else child_name, child)
        # Containers have no forward of their own: FSDP2 cannot wrap them and FSDP1's size policy
        # excludes them, so their parameters count towards the parent.
        container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
        if name and not container and remaining >= min_num_params:
            units.append((name, module))
            return 0
        return remaining

    visit("", model)
    return units


def disable_kv_cache(model: nn.Module) -> None:
    """Activation checkpointing re-runs each layer's forward; a Hugging Face model with `use_cache`
    on would append the keys/values twice and fail on shape. HF's own gradient_checkpointing_enable
    turns the cache off for the same reason; the cache only serves generation, never training."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False


def apply_ac(model: nn.Module, units: list[tuple[str, nn.Module]]) -> None:
    """Non-reentrant activation checkpointing on every unit (the same units that become shard units),
    so `activation_checkpointing: true` recomputes the same regions on every backend."""
    disable_kv_cache(model)
    ids = {id(m) for _, m in units}
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                   check_fn=lambda m: id(m) in ids)


def at_unit_places(model: nn.Module, units: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """What sits at each unit's place in the tree: the unit itself, or the activation-checkpoint
    wrapper apply_ac put around it. Sharding and compiling that module keeps FSDP's hooks and the
    compiled region outside the recomputed one."""
    wrapper_of = {id(getattr(m, "_checkpoint_wrapped_module", None)): m for m in model.modules()}
    return [(name, wrapper_of.get(id(unit), unit)) for name, unit in units]


@dataclasses.dataclass(frozen=True)
class ForwardKwargs:
    """What the engine's forwards pass an HF model besides the batch: `always`, and `flattened`
    where the batch carries position ids (documents side by side may restart them)."""

    always: dict
    flattened: dict

    def every(self) -> dict:
        """Both: a pipeline stage's forward, built once for every batch."""
        return {**self.always, **self.flattened}

    def of(self, batch):
        """The batch with the kwargs it needs (a dict lookup: nothing read from the device)."""
        if not isinstance(batch, dict):
            return batch
        return {**batch, **self.always, **(self.flattened if "position_ids" in batch else {})}


def forward_kwargs(model: nn.Module, router: bool) -> ForwardKwargs:
    """use_cache=False where the batch carries position ids (with a KV cache transformers' masks
    skip a flattened row's documents: 1.2e-2 off, tiny Llama, sdpa); elsewhere the model's own
    default, as a hand-written loop calls it: without a cache transformers 5 searches the position
    ids for restarts in every forward, a read of the device each time (measured: 23 reads per
    step where the native loop's are 22). output_router_logits=False where the engine's balancing
    loss is global (router.py). Activation checkpointing turns the cache off in the config
    (disable_kv_cache)."""
    import inspect

    from parallel.kits.objective import base_model

    base = base_model(model)
    if not hasattr(getattr(base, "config", None), "use_cache"):
        return ForwardKwargs({}, {})
    accepted = inspect.signature(base.forward).parameters
    flattened = {"use_cache": False} if "use_cache" in accepted else {}
    return ForwardKwargs({"output_router_logits": False} if router else {}, flattened)
