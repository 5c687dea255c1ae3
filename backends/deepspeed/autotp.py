"""`topology.tp` on DeepSpeed: AutoTP (`tensor_parallel.autotp_size`) splitting by polyshard's plan
(docs/tp.md). deepspeed is imported only when an engine builds a `Split`.

DeepSpeed 0.19.8 picks its split from, in order, `tensor_parallel.partition_config`, the model's
Hugging Face tp plan, then name heuristics. polyshard always hands it the plan it resolved and checked
(parallel/engine/model/tp_plan.py: the spec's `topology.tp_plan` or the model's own) as a partition_config,
so DeepSpeed splits exactly the modules FSDP2 and XLA split, and nothing else (with a partition_config
AutoTP leaves unmatched layers alone)."""

from __future__ import annotations

import fnmatch
import re

import torch
import torch.distributed as dist

from parallel.checkpoint.chunks import Box, FlatRange

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


# ---- a split model's state (engine-time: deepspeed is imported by then) ----

META = "ds_autotp_universal_checkpoint_meta"  # deepspeed.checkpoint.constants.DS_AUTOTP_UC_META


class Split:
    """What AutoTP did to a model: this rank's place in its TP group and, per parameter name it
    split, where the local shard sits in the whole tensor (AutoTP's own per-parameter record:
    partition_dim, logical_shape, partition_sizes). Checkpoints write the shards as blocks of the
    whole tensors, so a TP checkpoint is the same portable state as any other."""

    def __init__(self, module, names: dict[int, str]):
        from deepspeed.utils import groups

        self.group = groups.get_tensor_model_parallel_group()
        self.rank = dist.get_rank(group=self.group)
        self.boxes = {names[id(p)]: box for p in module.parameters()
                      if (box := self._box(p)) is not None}
        self.split_ids = {id(p) for p in module.parameters() if names[id(p)] in self.boxes}

    def _box(self, p) -> Box | None:
        meta = getattr(p, META, None)
        if not meta or meta.get("replicated") or meta.get("partition_dim") is None:
            return None
        if meta.get("sub_param_shape") is not None:  # fused projections: pieces, not one block
            raise RuntimeError(f"AutoTP split a parameter of shape {meta['logical_shape']} into "
                               "sub-parameters, which polyshard's checkpoints cannot place; "
                               "split unfused projections (topology.tp_plan)")
        return Box.split(meta["logical_shape"], meta["partition_dim"], meta["partition_sizes"],
                         self.rank)

    def check(self, module, expected: dict[str, tuple], names: dict[int, str]) -> None:
        """Each parameter's shape on this rank is the plan's (tp_plan.local_shapes): AutoTP split
        exactly what FSDP2 and XLA split, evenly."""
        shape = lambda p: tuple(getattr(p, "ds_shape", p.shape))  # noqa: E731 (ZeRO-3: before
        wrong = {names[id(p)]: (shape(p), expected.get(names[id(p)]))  # its own partitioning)
                 for p in module.parameters() if expected.get(names[id(p)]) != shape(p)}
        if wrong:
            raise RuntimeError(f"AutoTP's split differs from the plan's (name: (AutoTP's, plan's "
                               f"shape on this rank)): {dict(list(wrong.items())[:4])}")

    def piece(self, name: str, local: torch.Tensor):
        """`local` (this rank's tensor of parameter `name`, or of an optimizer entry shaped like it)
        as the block of the whole tensor it is; a tensor AutoTP did not split as it is."""
        box = self.boxes.get(name)
        if box is None or local.dim() == 0:
            return local
        return FlatRange(local.detach().reshape(-1), 0, local.shape, box)

    def whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole tensor from the TP group's shards (collective over the group, every rank in
        the same order); a tensor AutoTP did not split as it is."""
        box = self.boxes.get(name)
        if box is None or local.dim() == 0:
            return local
        dim = next(d for d, (a, b) in enumerate(zip(box.full, local.shape)) if a != b)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def state(self, state: dict, convert) -> dict:
        """{"model": {name: t}, "optim": {"state": {name: {key: t}}, ...}} with each tensor
        converted by `convert(name, t)` (piece or whole)."""
        out = {"model": {k: convert(k, v) for k, v in state["model"].items()}}
        if "optim" in state:
            out["optim"] = {**state["optim"], "state": {
                k: {e: convert(k, v) if torch.is_tensor(v) else v for e, v in entries.items()}
                for k, entries in state["optim"]["state"].items()}}
        return out

    def grad_norm(self, params) -> torch.Tensor:
        """The global gradient norm where the split parameters' gradients are this rank's shards:
        their squares summed over the TP group (one scalar all-reduce), the rest counted once."""
        split, whole = [], []
        for p in params:
            if p.grad is not None:
                (split if id(p) in self.split_ids else whole).append(p.grad)
        device = (split or whole)[0].device
        squares = torch.stack([torch.nn.utils.get_total_norm(g, 2.0).to(device) ** 2 if g else
                               torch.zeros((), device=device) for g in (split, whole)])
        dist.all_reduce(squares[0:1], group=self.group)
        return squares.sum().sqrt()
