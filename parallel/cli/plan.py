"""`polyshard plan`: the table (or `--json`) of predicted per-rank peak memory, host memory per node
and communication time per step, and the pick: the least communication time that fits."""

from __future__ import annotations

import json
import math
import sys

from parallel.cli.args import COUNT, SEQ, WORLD, bounded

GiB = 2 ** 30


def suggestions(spec, rows) -> list[str]:
    """What could make it fit, naming only what is not already on."""
    out = ["more devices (--world)"]
    if not spec.checkpoint_activations:
        out.append("activation_checkpointing: true")
    if spec.micro_batch_size > 1:
        out.append(f"a smaller micro_batch_size (now {spec.micro_batch_size}; raise "
                   "grad_accum_steps to keep the batch)")
    if not any(r.offload == "params" for r in rows):
        out.append("a backend that offloads parameters")
    if spec.compute == "fp32":
        out.append("precision: bf16 (halves activations)")
    return out


def longest_line(spec, budget_gib: float, longest: int) -> str:
    cp = spec.topology.cp
    return (f"longest sequence within {budget_gib} GiB for this spec as written ({spec.backend}, "
            f"shard {spec.shard}, micro-batch {spec.micro_batch_size}, cp {cp}): {longest:,} "
            "tokens" + ("" if cp > 1 else " (topology.cp N holds about N times as many)"))


def pipeline_line(spec, cfg, seq: int, psi: float) -> str:
    from parallel.tools.stages import pipeline_of

    facts = pipeline_of(spec, cfg, seq, psi)
    out = (f"pipeline: {facts['schedule']}, {facts['stages']} stages, {facts['microbatches']} "
           f"micro-batches per step: bubble {facts['bubble']:.1%} of each rank's step, "
           f"{facts['in_flight']} stage-chunk(s) of activations in flight on the first rank")
    if "p2p_bytes" in facts:
        out += (f"; {facts['p2p_bytes'] / 2**20:,.1f} MiB sent point-to-point per rank per step; "
                f"the heaviest pipeline rank holds {facts['stage_params'] / 1e9:.3g} B parameters")
    if "activations" in facts:
        out += f", {facts['activations'] / GiB:.2f} GiB of activations"
    return out + " (the rows above count the heaviest pipeline rank's stages; docs/pipeline.md)"


def experts_of(spec, cfg, seq: int) -> dict | None:
    """topology.ep's facts for --json (tools/experts.py), None without it."""
    from parallel.tools.experts import all_to_all_bytes

    moe = (cfg or {}).get("_moe") if spec.topology.ep > 1 else None
    return None if moe is None else {**moe, "all_to_all_bytes": all_to_all_bytes(moe, spec, seq)}


def ep_line(spec, cfg, seq: int) -> str:
    from parallel.tools.experts import expert_line

    moe = (cfg or {}).get("_moe")
    if moe is None:
        return ("expert parallelism: the model has no mixture-of-experts blocks plan can read "
                "(a parameter count, or no `experts` ModuleList): its experts are not modelled")
    return expert_line(moe, spec, seq)


def cells(spec, r, best, budget: float | None) -> list[str]:
    """One row of plan's table: the estimate, and whether it is the spec as written, fits, or is
    the best that fits."""
    fits = "" if budget is None else ("fits" if r.total <= budget else "[red]over[/]")
    act = "n/a" if r.activations is None else f"{r.activations / GiB:.2f}"
    marks = ["this spec"] if is_spec(spec, r) else []
    marks += ["[bold green]<- least comm that fits[/]"] if r is best else [fits] if fits else []
    return [r.backend, r.shard, r.offload, f"{r.state / GiB:.2f}",
            f"{(r.gathered + r.buffers) / GiB:.2f}", act, f"{r.margin / GiB:.2f}",
            f"{r.total / GiB:.2f}", f"{r.host_per_node / GiB:.1f}", f"{r.step_comm_s * 1e3:.1f}",
            f"{r.ckpt_bytes / GiB:.2f}", f"{r.ckpt_s:.1f}", ", ".join(marks)]


SWEPT = ("tp", "cp", "pp", "ep")


def run_sweep(args, spec_at) -> int:
    """`plan --sweep DIM=V1,V2,...`: the spec as written at each value (`spec_at([override])`), one
    row each: its peak, states, communication and checkpoint per rank; a value the spec's rules
    refuse is shown with why."""
    from rich.console import Console
    from rich.table import Table

    from parallel.spec.errors import SpecError
    from parallel.tools.facts import facts_of
    from parallel.tools.plan import Links, Margin, plan
    from parallel.tools.stages import stage_keep

    dim, _, values = args.sweep.partition("=")
    if dim not in SWEPT or not values or not all(v.strip().isdigit() for v in values.split(",")):
        raise SpecError([("--sweep", f"{args.sweep!r}: DIM=V1,V2,... with DIM one of "
                          f"{', '.join(SWEPT)} and whole numbers, e.g. ep=1,2,4,8")])
    links = Links(args.intra_gbps, args.inter_gbps, args.pcie_gbps, args.disk_gbps)
    table = Table(title=f"the spec at each {dim}, world {args.world}, seq {args.seq}")
    for col in (dim, "states", "transient", "activations", "peak GiB", "comm ms/step",
                "ckpt GiB/rank", "save s"):
        table.add_column(col, justify="right", no_wrap=True)
    for value in (int(v) for v in values.split(",")):
        try:  # the spec's rules, and the model's (ep over fused experts: facts_of)
            spec = spec_at([f"topology.{dim}={value}"])
            shapes, cfg, unit = facts_of(args.model, spec, stage_keep(spec))
        except SpecError as err:
            table.add_row(str(value), f"refused: {err.problems[0][1][:90]}", *[""] * 6)
            continue
        rows, _ = plan(spec, shapes, cfg, args.world, args.seq, args.optimizer, unit=unit,
                       links=links, margin=Margin(args.context_gib, args.fragmentation),
                       per_node=args.per_node)
        r = next(r for r in rows if is_spec(spec, r))
        act = "n/a" if r.activations is None else f"{r.activations / GiB:.2f}"
        table.add_row(str(value), f"{r.state / GiB:.2f}", f"{(r.gathered + r.buffers) / GiB:.2f}",
                      act, f"{r.total / GiB:.2f}", f"{r.step_comm_s * 1e3:.1f}",
                      f"{r.ckpt_bytes / GiB:.2f}", f"{r.ckpt_s:.1f}")
    Console(width=None if sys.stdout.isatty() else 250).print(table)
    return 0


def is_spec(spec, r) -> bool:
    """The row of the spec as written (its backend, shard and offload)."""
    return (r.backend, r.shard, r.offload) == (spec.backend, spec.shard, spec.offload)


def as_json(spec, args, rows, best, psi, unit, links, margin, longest, cfg=None) -> str:
    from parallel.tools.stages import pipeline_of

    def row(r):
        return {"backend": r.backend, "shard": r.shard, "offload": r.offload,
                **{k: getattr(r, k) for k in ("params", "grads", "optimizer", "activations",
                                              "gathered", "buffers", "margin", "host_per_node",
                                              "comm_s", "offload_s", "ckpt_bytes", "ckpt_s")},
                "peak": r.total, "fits": None if args.budget is None else
                r.total <= args.budget * GiB, "best": r is best, "spec": is_spec(spec, r)}

    return json.dumps({"parameters": psi, "tp": spec.topology.tp, "cp": spec.topology.cp,
                       "longest_seq": longest, "largest_unit": unit,
                       "world": args.world,
                       "per_node": args.per_node,
                       "micro_batch_size": spec.micro_batch_size, "seq": args.seq,
                       "precision": spec.precision, "budget_gib": args.budget,
                       "links_gbps": vars(links), "margin": vars(margin),
                       "pipeline": pipeline_of(spec, cfg, args.seq, psi),
                       "experts": experts_of(spec, cfg, args.seq),
                       "rows": [row(r) for r in rows]}, indent=1)


def run_plan(spec, args) -> int:
    from rich.console import Console
    from rich.table import Table

    from parallel.tools.facts import facts_of
    from parallel.tools.plan import Links, Margin, longest_seq, plan
    from parallel.tools.stages import stage_keep

    shapes, cfg, unit = facts_of(args.model, spec, stage_keep(spec))
    budget = args.budget * GiB if args.budget else None
    links = Links(args.intra_gbps, args.inter_gbps, args.pcie_gbps, args.disk_gbps)
    margin = Margin(args.context_gib, args.fragmentation)
    rows, best = plan(spec, shapes, cfg, args.world, args.seq, args.optimizer, budget_bytes=budget,
                      unit=unit, links=links, margin=margin, per_node=args.per_node)
    psi = float(sum(math.prod(s) for s in shapes))
    # the longest row this spec, as written, fits in the budget (activations grow with it)
    longest = longest_seq(spec, shapes, cfg, budget, args.optimizer, unit=unit, margin=margin) \
        if budget and cfg else None
    if args.json:
        print(as_json(spec, args, rows, best, psi, unit, links, margin, longest, cfg))
        return 0 if budget is None or best is not None else 1
    nodes = f"{args.world // args.per_node} node(s) x {args.per_node}" \
        if args.world % args.per_node == 0 else "1 node"
    params = f"{psi / 1e9:.3g} B parameters" + (f" per tensor-parallel rank (tp {spec.topology.tp})"
                                                   if spec.topology.tp > 1 else "")
    table = Table(title=f"per-rank peak, {params}, world {args.world} ({nodes}), "
                  f"micro-batch {spec.micro_batch_size} x seq {args.seq}, {spec.precision}")
    for col in ("backend", "shard", "offload", "states", "transient", "activations", "margin",
                "peak GiB", "host GiB/node", "comm ms/step", "ckpt GiB/rank", "save s", ""):
        table.add_column(col, justify="left" if col in ("backend", "shard", "offload") else "right",
                         no_wrap=True)
    for r in sorted(rows, key=lambda r: not is_spec(spec, r)):  # the spec as written first
        table.add_row(*cells(spec, r, best, budget))
    console = Console(width=None if sys.stdout.isatty() else 250)  # a log keeps every column
    console.print(table)
    console.print(
        f"states: parameters + gradients + optimizer between steps; transient: gathered units "
        f"and buckets at the peak (largest unit {unit / 1e6:.1f} M parameters)" if unit else
        "states: parameters + gradients + optimizer; transient: the whole model as one unit (a "
        "bare parameter count has no structure)", highlight=False, soft_wrap=True)
    console.print(f"margin: CUDA context {margin.context_gib} GiB + {margin.fragmentation:.0%} "
                  f"fragmentation; comm: ring collectives at {links.intra} GB/s in a node, "
                  f"{links.inter} GB/s across nodes, offload over PCIe at {links.pcie} GB/s, no "
                  f"overlap (an upper bound); ckpt: fp32 weights + optimizer state a rank writes, "
                  f"saved at {links.disk} GB/s; --json for every number", highlight=False, soft_wrap=True)
    notes = [pipeline_line(spec, cfg, args.seq, psi) if spec.topology.pp > 1 else None,
             ep_line(spec, cfg, args.seq) if spec.topology.ep > 1 else None,
             longest_line(spec, args.budget, longest) if longest is not None else None]
    for note in filter(None, notes):
        console.print(note, highlight=False, soft_wrap=True)
    if budget is not None and best is None:
        console.print(f"[red]nothing fits in {args.budget} GiB per device[/]: "
                      + "; ".join(suggestions(spec, rows)), soft_wrap=True)
        return 1
    return 0


def add_dryrun(p, add_spec_args) -> None:
    add_spec_args(p)
    p.add_argument("--model", required=True, help="HF config.json, toy:NAME or module:function "
                   "(built on the meta device; only this rank's shards get memory)")
    p.add_argument("--world", type=COUNT, required=True, help="ranks of the job (any number: one "
                   "process plays one of them over torch's fake process group)")
    p.add_argument("--rank", type=bounded(int, 0, WORLD - 1), default=1,
                   help="which rank to build (default 1: rank 0 "
                   "would build the whole model where a real job loads it)")
    p.add_argument("--seq", type=SEQ, default=16, help="tokens per sample of the two steps run")
    p.add_argument("--json", action="store_true", help="every number as JSON on stdout")


def run_dryrun(spec, args) -> int:
    from rich.console import Console
    from rich.table import Table

    from parallel.tools.dryrun import run

    if not 0 <= args.rank < args.world:
        raise SystemExit(f"error: --rank {args.rank}: pick 0 <= rank < --world {args.world}")
    got = run(spec, args.model, args.world, args.rank, args.seq)
    if args.json:
        print(json.dumps({"world": got.world, "rank": got.rank, "tp": got.tp, "cp": got.cp,
                          "seq": args.seq,
                          "measured": got.measured, "planned": got.planned,
                          "collectives": got.collectives, "changed": got.changed}, indent=1))
        return 0
    console = Console(width=200, soft_wrap=True)
    table = Table(title=f"rank {got.rank} of {got.world} (tp {got.tp}, cp {got.cp}), measured over a fake "
                  f"process group beside `polyshard plan`, seq {args.seq}")
    for col in ("bytes per rank", "measured", "plan", "plan error"):
        table.add_column(col, justify="right" if col != "bytes per rank" else "left")
    for key, measured, planned, err in got.rows():
        table.add_row(key, f"{measured:,}" if measured is not None else "-",
                      f"{planned:,.0f}" if planned is not None else "-",
                      f"{err:+.1%}" if err is not None else "-")
    console.print(table)
    comm = Table(title="collectives in one step (all-gather: output bytes; reduce-scatter: input)")
    for col in ("type", "calls", "bytes", "plan", "plan error"):
        comm.add_column(col, justify="left" if col == "type" else "right")
    for kind, row in got.collectives.items():
        planned, counted = row.get("planned"), row["bytes"]
        comm.add_row(kind, str(row["calls"]), f"{counted:,}",
                     f"{planned:,.0f}" if planned is not None else "-",
                     f"{(planned - counted) / counted:+.1%}" if planned and counted else "-")
    console.print(comm)
    console.print(f"changed for the dry run: {got.changed} (values are garbage; memory, shapes "
                  "and collectives are the job's)", highlight=False)
    return 0
