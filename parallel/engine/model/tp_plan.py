"""The tensor-parallel plan a job splits by, for every backend (`topology.tp`, docs/tp.md): the
spec's `topology.tp_plan` or the model's own, checked against the model before anything is split,
and what each style leaves one rank of a parameter (`local_shape`: what `plan` counts and
`explain` prints). Backends apply it their own way (FSDP2: backends/fsdp/parallelize.py apply_tp)."""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn

from parallel.spec.errors import SpecError

# The styles every backend splits by (the spec's topology.tp_plan takes these): colwise splits a
# Linear's outputs, rowwise its inputs, colwise_rep its outputs gathered whole (an LM head).
STYLES = ("colwise", "rowwise", "colwise_rep")
# transformers 5's names for them (colwise_rep became colwise_gather_output in transformers #42809)
RENAMED = {"colwise_gather_output": "colwise_rep"}
# entries of a model's own plan that every backend keeps whole: transformers 5 adds
# {"model.embed_tokens": "embedding_rowwise"} (a vocabulary-parallel embedding) to every model's plan
# (#47579); polyshard splits no embedding, as DeepSpeed's AutoTP with vocab_parallel_lm_head false
# keeps it whole too (docs/tp.md)
KEPT_WHOLE = ("embedding_rowwise",)


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan as {module path (fnmatch, from the model's root): style},
    from transformers' `base_model_tp_plan` (under the base model's attribute) and the head
    class's `_tp_plan`; {} for a model without one. A PEFT model: its Hugging Face model's plan
    under the path PEFT puts it at (base_model.model.)."""
    inner = getattr(model, "get_base_model", None)
    if callable(inner) and inner() is not model:
        base = inner()
        path = next((n for n, m in model.named_modules() if m is base), "")
        return {f"{path}.{k}" if path else k: v for k, v in hf_tp_plan(base).items()}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix if prefix and hasattr(model, prefix) else ""
    plan = {f"{inner}.{k}" if inner else k: v for k, v in base.items()}
    # the head's plan from the class: transformers 4.57's post_init replaces the instance's
    # `_tp_plan` with the config's base plan (unprefixed), losing {"lm_head": "colwise_rep"}
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    return {k: RENAMED.get(v, v) for k, v in plan.items() if v not in KEPT_WHOLE}


def resolve_plan(model: nn.Module, tp: int, spec_plan: dict[str, str] | None,
                 say=None) -> dict[str, str]:
    """The plan a job splits by (the spec's `topology.tp_plan`, else the model's own), after
    checking that every entry names Linear layers and that what it splits divides by tp: a
    projection's split side and the attention's head counts (each rank runs heads / tp heads).
    An entry whose weight is tied to a module the plan keeps whole (a head tied to the input
    embedding) stays whole: dropped from the model's own plan (`say` tells it), refused in yours."""
    field = "topology.tp_plan" if spec_plan is not None else "topology.tp"
    plan = lora_parts(model, spec_plan if spec_plan is not None else hf_tp_plan(model))
    unknown = {k: v for k, v in plan.items() if v not in STYLES}
    if unknown:  # the model's own (Mixtral's experts: local_colwise, gather, ...)
        raise SpecError([(field, f"{type(model).__name__}'s tp plan has entries in styles polyshard "
                          f"does not split by: {dict(list(unknown.items())[:4])} (it splits "
                          f"{', '.join(STYLES)}); give topology.tp_plan for the projections to "
                          "split (what it leaves out stays whole)")])
    tied = _tied_to_whole(model, plan)
    if tied and spec_plan is not None:
        raise SpecError([(field, f"{pattern!r} splits {names[0]}, whose weight is also "
                          f"{names[1]}, which the plan keeps whole: one weight cannot be split for "
                          "one module and whole for the other; remove the entry (the head then "
                          "stays whole on every TP rank) or untie the weights")
                         for pattern, names in tied.items()])
    if tied:
        plan = {k: v for k, v in plan.items() if k not in tied}
        if say is not None:
            say(f"topology.tp: {', '.join(n[0] for n in tied.values())} stays whole on every TP "
                f"rank: its weight is tied to {', '.join(n[1] for n in tied.values())}, which the "
                "model's plan keeps whole (one process's tie, kept; docs/tp.md)")
    if not plan:
        raise SpecError([("topology.tp_plan", f"unset, and {type(model).__name__} has no tp plan of "
                          "its own (Hugging Face's base_model_tp_plan); give {module path: colwise "
                          "| rowwise | colwise_rep} for its projections")])
    problems = []
    for key, value in _head_counts(model).items():
        if value % tp:
            problems.append((field, f"tp {tp} does not divide the model's {key} {value}; pick a "
                             "divisor"))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for pattern, style in plan.items():
        hits = [(n, m) for n, m in linears.items() if fnmatch(n, pattern)]
        if not hits:
            problems.append((field, f"{pattern!r} ({style}) matches no Linear layer of "
                             f"{type(model).__name__}; module paths start at the model's root"))
        for name, m in hits[:1]:  # a pattern's layers share their shape
            size = m.in_features if style == "rowwise" else m.out_features
            if size % tp:
                problems.append((field, f"tp {tp} does not divide {name}'s "
                                 f"{'in' if style == 'rowwise' else 'out'}_features {size} "
                                 f"({style}); pick a divisor"))
    if problems:
        raise SpecError(problems)
    return dict(plan)


def held_part(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The entries of a plan resolved on the whole model that match a layer of `model`, one
    pipeline stage of it (the head's entry on the last stage only)."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return {k: v for k, v in plan.items() if any(fnmatch(n, k) for n in linears)}


def lora_parts(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The plan carried into PEFT's LoRA layers, which wrap the Linear a plan names: the base layer
    splits as planned, and the adapter so that its delta is laid out like the base's output:
    colwise (outputs split) splits lora_B's outputs too (lora_A whole: its input is whole);
    rowwise (inputs split) splits lora_A's inputs (its output then summed over the TP group, as
    the base's is) and keeps lora_B whole. One process's LoRA, split."""
    out = {}
    for pattern, style in plan.items():
        hits = [m for n, m in model.named_modules() if fnmatch(n, pattern)]
        lora = [m for m in hits if isinstance(getattr(m, "base_layer", None), nn.Linear)
                and isinstance(getattr(m, "lora_A", None), nn.ModuleDict)]
        if not lora:
            out[pattern] = style
            continue
        out[f"{pattern}.base_layer"] = style
        part = "lora_A" if style == "rowwise" else "lora_B"
        for adapter in getattr(lora[0], part):
            out[f"{pattern}.{part}.{adapter}"] = style
    return out


def _tied_to_whole(model: nn.Module, plan: dict[str, str]) -> dict[str, tuple[str, str]]:
    """{plan entry: (the weight it splits, a name of the same weight the plan keeps whole)}."""
    from parallel.engine.model.params import tied_groups

    out = {}
    for names in tied_groups(model):
        owners = {n: pattern_of(n.rpartition(".")[0], plan) for n in names}
        split = [n for n, pattern in owners.items() if pattern is not None]
        whole = [n for n, pattern in owners.items() if pattern is None]
        if split and whole:
            out.setdefault(owners[split[0]], (split[0], whole[0]))
    return out


def _head_counts(model: nn.Module) -> dict[str, int]:
    config = getattr(model, "config", None)
    names = ("num_attention_heads", "num_key_value_heads")
    return {n: getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)}


def local_shape(shape: tuple[int, ...], style: str | None, leaf: str, tp: int) -> tuple[int, ...]:
    """One TP rank's share of parameter `leaf` ("weight"/"bias") of a Linear split by `style`:
    colwise and colwise_rep split the outputs (weight dim 0, bias), rowwise the inputs (weight
    dim 1; its bias is added once after the sum, whole on every rank); None: not split."""
    if style is None or tp == 1:
        return tuple(shape)
    if style == "rowwise":
        return (shape[0], shape[1] // tp, *shape[2:]) if leaf == "weight" else tuple(shape)
    return (shape[0] // tp, *shape[1:])


def pattern_of(module_path: str, plan: dict[str, str]) -> str | None:
    """The first plan entry whose pattern matches `module_path` (parallelize_module's rule), or
    None: not split."""
    return next((pattern for pattern in plan if fnmatch(module_path, pattern)), None)


def style_of(module_path: str, plan: dict[str, str]) -> str | None:
    pattern = pattern_of(module_path, plan)
    return None if pattern is None else plan[pattern]


def local_shapes(model: nn.Module, tp: int, spec_plan: dict[str, str] | None = None
                 ) -> list[tuple[str, tuple[int, ...], str | None]]:
    """(name, one TP rank's shape, matched plan entry) of every parameter, after resolve_plan's
    checks."""
    plan = resolve_plan(model, tp, spec_plan) if tp > 1 else {}
    return split_shapes(model, tp, plan)


def split_shapes(model: nn.Module, tp: int, plan: dict[str, str]):
    """(name, one TP rank's shape, matched plan entry) of every parameter under a resolved plan."""
    out = []
    for name, p in model.named_parameters():
        path, _, leaf = name.rpartition(".")
        pattern = pattern_of(path, plan)
        style = None if pattern is None else plan[pattern]
        out.append((name, local_shape(tuple(p.shape), style, leaf, tp), pattern))
    return out


def describe(model: nn.Module, tp: int, spec_plan: dict[str, str] | None = None) -> dict:
    """`polyshard explain --model`'s view of the split: per plan entry its style, how many layers
    it matched and one weight's full and per-rank shapes; and what stays whole on every rank."""
    plan = resolve_plan(model, tp, spec_plan)
    entries = {pattern: {"style": style, "modules": 0} for pattern, style in plan.items()}
    whole = 0
    for name, shape, pattern in split_shapes(model, tp, plan):
        if pattern is None:
            whole += 1
        elif name.endswith(".weight"):
            entry = entries[pattern]
            entry["modules"] += 1
            entry.setdefault("weight", list(model.get_parameter(name).shape))
            entry.setdefault("weight_per_rank", list(shape))
    return {"size": tp, "plan": entries, "whole_parameters": whole}
