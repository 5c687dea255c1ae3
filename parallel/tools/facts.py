"""The model as `plan` and `dryrun` see it, before any rank builds it: one rank's parameter shapes
(its tensor-parallel split, its pipeline stages), the config that sizes activations, the shard
units FSDP gathers one at a time, and what prepare would refuse about the layout."""

from __future__ import annotations

import math

from parallel.tools.experts import expert_blocks, moe_facts


def check_model_layout(model, tp: int, cp: int) -> None:
    """What prepare would refuse about the model at this layout, refused now (validate, explain,
    plan and dryrun with --model): cp must divide each tensor-parallel rank's query heads."""
    if cp <= 1:
        return
    from parallel.engine.model.context_parallel import kv_repeat
    from parallel.spec.errors import SpecError

    bad = kv_repeat(getattr(model, "config", None), tp, cp)[1]
    if bad:
        raise SpecError([("topology.cp", f"{cp}: {type(model).__name__}: {bad}; pick a cp that "
                          "divides it")])


def model_facts(source: str, wrap, tp: int = 1, tp_plan: dict | None = None, cp: int = 1,
                keep=None, ep: int = 1) -> tuple[list[tuple[int, ...]], dict | None, float | None]:
    """One tensor-parallel rank's parameter shapes (all of them at tp 1), the config that sizes
    activations, and the largest shard unit's parameters on that rank (the wrap policy on the
    model built on the meta device: nothing allocated); a bare parameter count gives neither
    config nor units, and no split. `keep(model, {name: shape})`: the names a pipeline rank holds
    (tools/stages.py's stage_keep), the others left out. `ep`: topology.ep, whose experts are
    units of their own (the config then carries the experts' facts, tools/experts.py: `_moe`)."""
    try:
        count = float(source)
    except ValueError:
        count = None
    if count is not None:
        from parallel.spec.errors import SpecError
        from parallel.kits.model_limits import PARAM_LIMIT

        if not (math.isfinite(count) and 1 <= count <= PARAM_LIMIT):
            raise SpecError([("--model", f"{source}: a parameter count is a number from 1 to "
                              f"{PARAM_LIMIT:.0e}")])
        return [(int(count) // tp,)], None, None
    from parallel.engine.model.tp_plan import local_shapes
    from parallel.toy import meta_model

    model = meta_model(source)
    check_model_layout(model, tp, cp)
    if ep > 1:  # what the engine refuses, plan refuses (transformers 5's fused experts)
        from parallel.engine.model.moe.expert_parallel import refuse_unsplit
        from parallel.engine.model.moe.experts import moe_blocks

        if not moe_blocks(model):
            refuse_unsplit(model, ep)
    local = {name: shape for name, shape, _ in local_shapes(model, tp, tp_plan)}
    if keep is not None:
        held = keep(model, local)
        local = {n: shape for n, shape in local.items() if n in held}
    units = unit_sizes(model, wrap, local, ep)
    cfg = model.config.to_dict()  # which attention runs sizes activations; to_dict() leaves it out
    cfg["_attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    cfg["_params"] = sum(p.numel() for p in model.parameters())  # the whole model's (checkpoints)
    if ep > 1:
        cfg["_moe"] = moe_facts(model, ep, None if keep is None else set(local))
    return list(local.values()), cfg, float(max(units)) if units else None


def unit_sizes(model, wrap, local: dict, ep: int = 1) -> list[int]:
    """The parameters of each shard unit on this rank (`local`: its shapes by name): with ep each
    expert a unit of its own, before the blocks' (which leave them out); the wrap policy's units;
    then what no unit holds, gathered by the outer units (FSDP2's edges: the embedding alone, the
    final norm with the head): a vocabulary-sized embedding outweighs a block (Llama-3-8B: 525M
    against 218M; at tp 8 not split at all), measured by `polyshard dryrun` (docs/tp.md)."""
    from parallel.engine.model.wrap import plan_wrap

    # a tied weight (lm_head.weight is embed_tokens.weight) is one parameter under its first name,
    # as named_parameters() and the shard units hold it
    first = {id(p): n for n, p in model.named_parameters()}
    held = [e for _, block in expert_blocks(model) for e in block.experts] if ep > 1 else []
    units, inside = [], set()
    for expert in held:
        mine = {first[id(p)] for p in expert.parameters()} & local.keys()
        units.append(sum(math.prod(local[n]) for n in mine))
        inside.update(mine)
    experts = set(inside)
    for _, m in plan_wrap(model, wrap):
        mine = ({first[id(p)] for p in m.parameters()} & local.keys()) - experts
        units.append(sum(math.prod(local[n]) for n in mine))
        inside.update(mine)
    for m in model.modules():
        own = ({first[id(p)] for p in m.parameters(recurse=False)} & local.keys()) - inside
        if own:
            units.append(sum(math.prod(local[n]) for n in own))
            inside.update(own)
    return units


def facts_of(source: str, spec, keep=None):
    """model_facts for `spec`'s layout (its wrap policy, tp, cp and ep)."""
    t = spec.topology
    return model_facts(source, spec.wrap, t.tp, t.tp_plan, t.cp, keep, t.ep)
