"""`polyshard bench --seq 1024,2048,... --budget GIB`: the same cells at each sequence length, each a
bench of its own (report.bench: fresh launches, memory measured per rank), and the longest length
each cell ran within the budget; with the spec's topology.cp above 1, the same sweep at cp 1 beside
it (the same ranks holding whole rows: data parallelism takes cp's place), so the table shows what
context parallelism buys. A length that fails (out of memory, a refusal) did not run."""

from __future__ import annotations

import json
from pathlib import Path

MiB = 2 ** 20


def layouts(spec) -> dict:
    """{label: spec}: the spec, and at cp 1 beside it where its cp is above 1, on the same global
    batch: cp 1 has cp times the data-parallel ranks, so each takes 1/cp of the rows (a smaller
    micro-batch, else fewer micro-batches); otherwise cp 1 would run cp times the rows a step."""
    from parallel.spec.errors import SpecError
    from parallel.spec.io import load_spec

    cp = spec.topology.cp
    if cp == 1:
        return {"cp 1": spec}
    data = spec.model_dump(mode="json", exclude_unset=True)
    data.pop("global_batch_size", None)
    mbs, accum = spec.micro_batch_size, spec.grad_accum_steps
    if mbs % cp == 0:
        data["micro_batch_size"] = mbs // cp
    elif accum % cp == 0:
        data["grad_accum_steps"] = accum // cp
    else:
        raise SpecError([("micro_batch_size", f"{mbs} (x grad_accum_steps {accum}): bench --seq "
                          f"compares cp {cp} with cp 1 on the same global batch, whose cp {cp} "
                          f"times as many data-parallel ranks each take 1/{cp} of the rows; pick a "
                          f"micro_batch_size or grad_accum_steps that cp {cp} divides")])
    return {"cp 1": load_spec({**data, "topology": {**data["topology"], "cp": 1}}),
            f"cp {cp}": spec}


def seq_sweep(spec, names, seqs: list[int], budget_gib: float | None, options: dict,
              out_dir: Path, say=lambda line: None) -> dict:
    from parallel.tools.bench.report import bench

    rows = []
    for label, laid in layouts(spec).items():
        for seq in seqs:
            say(f"-- {label}, {seq:,} tokens per row")
            got = bench(laid, names, None, [], {**options, "seq": seq},
                        out_dir / f"{label.replace(' ', '')}-seq{seq}", say=say)
            for cell, r in got.items():
                peak = r.get("peak_measured_bytes")
                ran = "median_s" in r
                rows.append({"layout": label, "cell": cell, "seq": seq, "ran": ran,
                             "peak_bytes": peak, "planned_bytes": r.get("peak_planned_bytes"),
                             "ms_per_step": r["median_s"] * 1e3 if ran else None,
                             "tokens_per_s": r.get("tokens_per_s"),
                             "target_tokens_per_s": r.get("target_tokens_per_s"),
                             "fits": ran and (budget_gib is None or (
                                 peak is not None and peak <= budget_gib * 2 ** 30)),
                             "why": None if ran else (r.get("skipped") or
                                                      (r.get("error") or "").strip()[-300:])})
    longest: dict = {}
    for row in rows:
        key = f"{row['layout']} {row['cell']}"
        longest.setdefault(key, 0)
        if row["fits"]:
            longest[key] = max(longest[key], row["seq"])
    result = {"budget_gib": budget_gib, "seqs": seqs, "rows": rows, "longest": longest}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep.json").write_text(json.dumps(result, indent=1))
    return result


def render_sweep(result: dict, console) -> None:
    from rich.table import Table

    budget = result["budget_gib"]
    table = Table(title="sequence sweep: one rank's peak per length" + (
        f" (budget {budget} GiB per rank)" if budget else ""))
    for col in ("layout", "cell", "tokens", "peak MiB", "plan MiB", "ms/step", ""):
        table.add_column(col, justify="left" if col in ("layout", "cell", "") else "right",
                         no_wrap=True)
    for r in result["rows"]:
        mark = ("fits" if r["fits"] else "[red]over[/]") if r["ran"] else f"[red]{(r['why'] or '')[:60]}[/]"
        table.add_row(r["layout"], r["cell"], f"{r['seq']:,}",
                      f"{r['peak_bytes'] / MiB:,.0f}" if r["peak_bytes"] else "-",
                      f"{r['planned_bytes'] / MiB:,.0f}" if r["planned_bytes"] else "-",
                      f"{r['ms_per_step']:,.0f}" if r["ms_per_step"] else "-", mark)
    console.print(table)
    for key, seq in result["longest"].items():
        console.print(f"longest within the budget, {key}: " + (f"{seq:,} tokens" if seq else
                                                               "none of the lengths"),
                      highlight=False)
