"""`topology.tp` on DeepSpeed: AutoTP (`tensor_parallel.autotp_size`) splitting by polyshard's plan
(docs/tp.md): the plan as AutoTP's partition_config and back, pure (no torch: `polyshard validate`
and imports read it); what AutoTP did to a model is autotp_split.py's `Split`.

DeepSpeed 0.19.8 picks its split from, in order, `tensor_parallel.partition_config`, the model's
Hugging Face tp plan, then name heuristics. polyshard always hands it the plan it resolved and checked
(parallel/engine/model/tp_plan.py: the spec's `topology.tp_plan` or the model's own) as a partition_config,
so DeepSpeed splits exactly the modules FSDP2 and XLA split, and nothing else (with a partition_config
AutoTP leaves unmatched layers alone)."""

from __future__ import annotations

import fnmatch
import re

# polyshard's styles (parallel/engine/model/tp_plan.py: STYLES) as AutoTP layer specs. colwise_rep gathers the
# output whole on every rank, as torch's ColwiseParallel(output_layouts=Replicate()) does.
SPECS = {"colwise": {"partition_type": "column"},
         "colwise_rep": {"partition_type": "column", "gather_output": True},
         "rowwise": {"partition_type": "row"}}


def weight_regex(pattern: str) -> str:
    """An fnmatch module path (from the model's root) as the regex AutoTP matches, with re.match,
    against the weight's parameter name."""
    return fnmatch.translate(pattern).removesuffix(r"\Z") + r"\.weight\Z"


def partition_config(plan: dict[str, str]) -> dict:
    """AutoTP's partition_config for `plan`, in the plan's order (both take the first match)."""
    return {"use_default_specs": False, "strict_mode": False,
            "layer_specs": [{"patterns": [weight_regex(path)], **SPECS[style]}
                            for path, style in plan.items()]}


# regex pieces a module-path pattern can be read back from: .* is fnmatch's *, . its ?, \. a dot
_TOKEN = re.compile(r"\.\*|\\\.|\[[A-Za-z0-9_]+\]|[A-Za-z0-9_]|\.")
STYLE_OF = {("column", False): "colwise", ("column", True): "colwise_rep", ("row", False): "rowwise"}


def fnmatch_of(regex: str) -> str:
    """The module path pattern whose weight `regex` matches as AutoTP matches (re.match on the
    parameter name), where one reads back exactly: polyshard's own (weight_regex) and
    hand-written ones like `.*\\.o_proj\\.weight$`; ValueError naming the regex otherwise."""
    body = re.sub(r"\\\.weight(\$|\\Z)$", "", regex)
    if body == regex:
        raise ValueError(f"{regex!r} does not end in \\.weight$ (a weight's full name)")
    if body.startswith("(?s:") and body.endswith(")"):
        body = body[4:-1]
    tokens = _TOKEN.findall(body)
    if "".join(tokens) != body:
        raise ValueError(f"{regex!r} uses regex syntax a module path pattern cannot say")
    # token by token: each piece means in fnmatch what it meant in the regex
    return "".join({".*": "*", "\\.": ".", ".": "?"}.get(t, t) for t in tokens)


def plan_of(config: dict) -> dict[str, str]:
    """AutoTP's partition_config as topology.tp_plan, where it is one: column or row splits of
    whole weights by patterns that read back; ValueError naming what has no equivalent."""
    extra = {k: v for k, v in config.items() if k not in ("layer_specs", "use_default_specs",
                                                          "strict_mode", "tp_size")}
    if extra or config.get("strict_mode"):
        raise ValueError(f"{extra or {'strict_mode': True}}: polyshard splits what the plan names "
                         "and leaves every other layer whole, with no head or embedding rules")
    plan = {}
    for spec in config.get("layer_specs", []):
        other = {k: v for k, v in spec.items()
                 if k not in ("patterns", "partition_type", "gather_output") and v not in (None, False)}
        key = (str(spec.get("partition_type", "column")).lower(), bool(spec.get("gather_output")))
        if other or key not in STYLE_OF:
            raise ValueError(f"layer spec {spec}: only whole column (gather_output: colwise_rep) "
                             "and row splits have a topology.tp_plan style")
        plan.update({fnmatch_of(p): STYLE_OF[key] for p in spec.get("patterns", [])})
    return plan


def tensor_parallel_block(tp: int, plan: dict[str, str] | None) -> dict:
    """The config's tensor_parallel block: AutoTP at `tp`, the head as the plan says (no
    vocabulary-parallel loss of DeepSpeed's own), and the plan once known (the model's own plan is
    resolved at prepare)."""
    block: dict = {"autotp_size": tp, "vocab_parallel_lm_head": False}
    if plan is not None:
        block["partition_config"] = partition_config(plan)
    return block


def with_plan(config: dict, plan: dict[str, str]) -> dict:
    """The config (a copy) splitting by `plan`, resolved against the model at prepare."""
    block = {**config["tensor_parallel"], "partition_config": partition_config(plan)}
    return {**config, "tensor_parallel": block}
