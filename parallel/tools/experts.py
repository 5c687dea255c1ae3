"""topology.ep in `plan` and `dryrun`: what splitting a mixture-of-experts model's experts over ep
ranks changes for one rank (parallel/engine/model/moe/expert_parallel.py does it).

- States: each rank holds n / ep experts of each block, sharded over the dp_shard x cp / ep ranks
  holding the same ones: per rank the same bytes as every expert sharded over dp_shard x cp.
- Gathered: the rank gathers only its own experts (each a unit of its own), so FSDP moves
  dense + experts / ep parameters per step where it moved the whole model (`gathered`).
- All-to-all, per block and forward: the per-expert row counts (int64), the rows out (tokens x
  top-k x hidden, in the compute dtype) and as many rows back; backward sends the two row exchanges
  again, and activation checkpointing's recomputation the forward's three. Rows back: one per row
  out, whatever the routing (each rank receives what its peers route to its experts: as many in
  all, on average; exactly, in a dry run, whose fake count exchange hands each rank its own).
"""

from __future__ import annotations

import math


def expert_blocks(model) -> list:
    """The model's mixture-of-experts blocks, (name, block), as the engine finds them."""
    from parallel.engine.model.moe.experts import moe_blocks

    return moe_blocks(model)


def moe_facts(model, ep: int, held=None) -> dict | None:
    """The model's mixture-of-experts blocks (meta-device model, Hugging Face's layout: an
    `experts` ModuleList): how many, their experts, top-k, one expert's parameters; None if none.
    `held`: the parameter names a pipeline rank holds (its stages' blocks only, their parameters
    the total), None: all."""
    names = {id(p): n for n, p in model.named_parameters()}
    mine = (lambda m: True) if held is None else (
        lambda m: any(names.get(id(p)) in held for p in m.parameters()))
    blocks = [(name, b) for name, b in expert_blocks(model) if mine(b)]
    if not blocks:
        return None
    _, block = blocks[0]
    config = getattr(model, "config", None)
    top_k = getattr(block, "top_k", None) or getattr(getattr(block, "gate", None), "top_k", None) \
        or getattr(config, "num_experts_per_tok", 1)
    shapes = [tuple(p.shape) for p in block.experts[0].parameters()]
    expert = sum(math.prod(shape) for shape in shapes)
    n = len(block.experts)
    total = float(sum(math.prod(p.shape) for name, p in model.named_parameters()
                      if held is None or name in held))
    experts = float(sum(len(b.experts) for _, b in blocks) * expert)
    return {"blocks": len(blocks), "experts": n, "top_k": int(top_k), "expert_params": expert,
            "expert_shapes": shapes,
            "hidden": int(getattr(config, "hidden_size", 0)), "ep": ep,
            "gathered": total - experts + experts / ep, "dense": total - experts}


def split_shapes(shapes: list, facts: dict) -> tuple[list, list]:
    """(the dense parameters' shapes, this rank's experts'): every expert's shapes taken out of
    `shapes` (the whole model's), n / ep of them per block kept."""
    from collections import Counter

    every = Counter({shape: 0 for shape in facts["expert_shapes"]})
    for shape in facts["expert_shapes"]:
        every[shape] += facts["blocks"] * facts["experts"]
    dense = []
    for shape in shapes:
        if every[tuple(shape)] > 0:
            every[tuple(shape)] -= 1
        else:
            dense.append(shape)
    held = facts["expert_shapes"] * (facts["blocks"] * facts["experts"] // facts["ep"])
    return dense, held


def extra_gather_bytes(facts: dict | None, spec) -> float:
    """Under activation checkpointing each held expert is gathered a third time per step: its unit
    sits inside the recomputed block (the block's own unit is the checkpoint wrapper, outside), so
    the recomputation gathers it again and backward once more (measured by `dryrun`)."""
    if facts is None or spec.topology.ep <= 1 or not spec.checkpoint_activations:
        return 0.0
    low = 4 if spec.compute == "fp32" else 2
    return (facts["gathered"] - facts["dense"]) * low * spec.grad_accum_steps


def all_to_all_bytes(facts: dict, spec, seq: int) -> float:
    """What one rank's all-to-alls carry per step (their input: counts, rows out, rows back), as
    `dryrun` counts them; 0 at ep 1."""
    if facts is None or spec.topology.ep <= 1:
        return 0.0
    low = 4 if spec.compute == "fp32" else 2
    tokens = spec.micro_batch_size * seq // spec.topology.cp
    rows = tokens * facts["top_k"] * facts["hidden"] * low
    counts = facts["experts"] * 8
    forward = counts + 2 * rows
    runs = 2 if spec.checkpoint_activations else 1  # the recomputation runs the forward again
    return facts["blocks"] * spec.grad_accum_steps * (runs * forward + 2 * rows)


def expert_line(facts: dict, spec, seq: int) -> str:
    """`plan`'s words for topology.ep."""
    per_rank = facts["blocks"] * facts["experts"] / facts["ep"]
    return (f"expert parallelism: ep {facts['ep']}, {per_rank:,.0f} experts per rank "
            f"({facts['experts']} per block / ep, each sharded over dp_shard x cp / ep "
            f"= {spec.dims.dp_mod_ep} ranks); FSDP gathers {facts['gathered'] / 1e9:.3g} B "
            f"parameters per step; all-to-all {all_to_all_bytes(facts, spec, seq) / 2**20:,.1f} "
            "MiB per rank per step (docs/moe.md)")


def shard_groups(spec, shapes: list, cfg: dict | None) -> list[tuple[list, int | None]]:
    """The rank's parameter shapes by the ranks they are sharded over (None: the spec's shard
    group): with topology.ep its experts apart, over the dp_shard x cp / ep ranks holding them."""
    moe = (cfg or {}).get("_moe") if spec.topology.ep > 1 else None
    if moe is None:
        return [(shapes, None)]
    dense, held = split_shapes(shapes, moe)
    return [(dense, None), (held, spec.dims.dp_mod_ep)]
