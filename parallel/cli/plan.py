"""`polyshard plan`: the rich table of predicted per-rank memory, and the pick."""

from __future__ import annotations

import math

GiB = 2 ** 30


def model_facts(source: str) -> tuple[list[tuple[int, ...]], dict | None]:
    """Parameter shapes and the config that sizes activations: from a model built on the meta
    device (nothing allocated), or a bare parameter count (no activations then)."""
    try:
        count = float(source)
    except ValueError:
        count = None
    if count is not None:
        return [(int(count),)], None
    from parallel.cli.main import _meta_model

    model = _meta_model(source)
    return [tuple(p.shape) for p in model.parameters()], model.config.to_dict()


def run_plan(spec, args) -> int:
    from rich.console import Console
    from rich.table import Table

    from parallel.tools.plan import plan

    shapes, cfg = model_facts(args.model)
    budget = args.budget * GiB if args.budget else None
    rows, best = plan(spec, shapes, cfg, args.world, args.seq, budget_bytes=budget)
    psi = sum(math.prod(s) for s in shapes)
    table = Table(title=f"per-rank memory, {psi / 1e9:.3g} B parameters, world {args.world}, "
                  f"micro-batch {spec.micro_batch_size} x seq {args.seq}, {spec.precision}")
    for col in ("backend", "shard", "offload", "params", "grads", "optimizer", "activations",
                "total GiB", ""):
        table.add_column(col, justify="right" if col not in ("backend", "shard", "offload") else "left")
    for r in rows:
        fits = "" if budget is None else ("fits" if r.total <= budget else "[red]over[/]")
        mark = "[bold green]<- fastest that fits[/]" if r is best else fits
        act = "n/a" if r.activations is None else f"{r.activations / GiB:.2f}"
        table.add_row(r.backend, r.shard, r.offload, f"{r.params / GiB:.2f}", f"{r.grads / GiB:.2f}",
                      f"{r.optimizer / GiB:.2f}", act, f"{r.total / GiB:.2f}", mark)
    console = Console()
    console.print(table)
    if budget is not None and best is None:
        console.print(f"[red]nothing fits in {args.budget} GiB per device[/]: more devices, "
                      "activation checkpointing, a smaller micro-batch, or offload")
        return 1
    return 0
