"""The bench table: narrow by default (fits 80 columns: what most people compare), every column with
`--wide` (also in bench.csv)."""

from __future__ import annotations

from pathlib import Path

from parallel.tools.bench.plot import plot
from parallel.tools.bench.report import MiB, loss_gap, save_text, vs_native

# target tok/s: tokens a loss counts (labels not -100) per second; tok/s (wide) counts every position
# fed, padding included, which made packed rows look 1.4x faster where their targets ran 3.3x
NARROW = ("cell", "ms/step", "target tok/s", "loss", "MiB/rank", "x native", "Δ loss")
WIDE = ("cell", "step ms (med / p90)", "target tok/s (all)", "loss", "params MiB", "grads MiB",
        "optim MiB", "RSS MiB", "peak MiB (plan, error)", "AG / RS / AR MiB/step", "MFU", "native ms",
        "x native", "Δ loss", "save blocks", "compile")


def _gap(r: dict) -> str:
    gap = loss_gap(r)
    return "-" if gap is None else ("0" if gap == 0 else f"{gap:.0e}")


def _states(r: dict) -> float:
    return (r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"]) / MiB


def _terminal() -> bool:
    import sys

    return sys.stdout.isatty()


def narrow_row(r: dict) -> list[str]:
    return [f"{r['median_s'] * 1e3:.0f}", f"{r['target_tokens_per_s']:.0f}", f"{r['loss_last']:.3f}",
            f"{_states(r):.1f}", vs_native(r), _gap(r)]


def wide_row(r: dict) -> list[str]:
    c, native = r["comm_bytes_per_step"], r.get("native") or {}
    comm = "n/a (in-graph)" if not r.get("comm_counted", True) else " / ".join(
        f"{c[k] / MiB:.2f}" for k in ("all_gather", "reduce_scatter", "all_reduce"))
    return [f"{r['median_s'] * 1e3:.0f} / {r['p90_s'] * 1e3:.0f}",
            f"{r['target_tokens_per_s']:.0f} ({r['tokens_per_s']:.0f})",
            f"{r['loss_first']:.3f}→{r['loss_last']:.3f}", f"{r['params_bytes'] / MiB:.2f}",
            f"{r['grads_bytes'] / MiB:.2f}", f"{r['optimizer_bytes'] / MiB:.2f}",
            f"{r['rss_peak_bytes'] / MiB:.0f}", peak_text(r), comm,
            "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
            f"{native['median_s'] * 1e3:.0f}" if "median_s" in native else "-",
            vs_native(r, interval=True), _gap(r), _saves(r), compile_text(r)]


def peak_text(r: dict) -> str:
    """The most tensor bytes a rank held in a step, measured, beside `polyshard plan`'s."""
    if "peak_error" not in r:
        return "-"
    return (f"{r['peak_measured_bytes'] / MiB:.1f} ({r['peak_planned_bytes'] / MiB:.1f}, "
            f"{r['peak_error']:+.0%})")


def compile_text(r: dict) -> str:
    """compile.enabled cells: first step (it compiles) / compiling alone, units that ran compiled,
    graphs and graph breaks."""
    c = r.get("compile")
    if not c:
        return "-"
    return (f"1st {r['first_step_s']:.1f}s (compile {c['compile_s']:.1f}s), {c['compiled']} units, "
            f"{c['graphs']}g {c['breaks']}b {c['recompiles']}rc")


def _saves(r: dict) -> str:
    saves = (r.get("ranks") or [{}])[0].get("saves")
    return save_text(saves) if saves else "-"


def render(results: dict, out_dir: Path, wide: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    columns = WIDE if wide else NARROW
    ran = {k: r for k, r in results.items() if "median_s" in r}
    # a cell that ran on other devices than asked (XLA v1 on a CPU host: one) is not comparable
    apart = {k: r for k, r in ran.items() if r.get("devices", r.get("asked_world"))
             != r.get("asked_world")}
    console = Console(width=None if _terminal() else 400)  # a log keeps every column whole
    for title, group in (("polyshard bench (per rank: the largest over ranks; w = devices it ran "
                          "on)", {k: r for k, r in ran.items() if k not in apart}),
                         ("ran on fewer devices than asked on this host: not comparable with "
                          "the table above", apart)):
        if not group:
            continue
        table = Table(title=title)
        for col in columns:
            table.add_column(col, justify="left" if col == "cell" else "right", no_wrap=True)
        for label, r in group.items():
            table.add_row(label, *(wide_row(r) if wide else narrow_row(r)))
        console.print(table)
    for label, r in results.items():  # in full: a reason cut to a column's width helps nobody
        if "median_s" not in r:
            note = r.get("skipped") or "error: " + r.get("error", "")[-600:]
            # markup=False: an error's own brackets (gloo's "[/path...]") are text, not rich tags
            console.print(f"{label}: {note}", highlight=False, soft_wrap=True, markup=False)
    if not wide:
        console.print("MiB/rank: parameters + gradients + optimizer state; Δ loss: largest loss "
                      "difference from the native loop; x native: median over steps of polyshard's "
                      "step time / the native step next to it (90% interval: --wide); every "
                      "column: --wide or bench.csv")
    planned = {label: peak_text(r) for label, r in ran.items() if "peak_error" in r}
    if planned and not wide:
        console.print("peak tensors per rank, measured MiB (polyshard plan's, its error): " +
                      "; ".join(f"{label}: {text}" for label, text in planned.items()),
                      highlight=False, soft_wrap=True, markup=False)
    compiled = {label: compile_text(r) for label, r in results.items() if r.get("compile")}
    if compiled and not wide:
        console.print("compile (steady-state steps above; the first step compiles): " + "; ".join(
            f"{label}: {text}" for label, text in compiled.items()), markup=False)
    figure = plot(results, out_dir)
    console.print(f"results: {out_dir / 'bench.json'}, {out_dir / 'bench.csv'}; figure: {figure}",
                  markup=False)
