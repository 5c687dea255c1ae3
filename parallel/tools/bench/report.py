"""`polyshard bench CONFIG --backends fsdp,deepspeed,xla_fsdp [--shard ...] [--world ...]`.

Every cell (backend x shard x world size) runs in a fresh launch from the same initial weights and
global batches (parallel/bench_run.py). Results: a rich table, `bench.json` and `bench.csv`, and PNG
figures (loss curves, throughput, memory per rank, communication per step) in the output directory.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from parallel.tools.bench.plot import plot
from parallel.launch.torchrun import run_locally
from parallel.registry import get
from parallel.spec.io import SpecError, load_spec

# peak dense TFLOP/s by device-name fragment: (bf16/fp16, tf32/fp32), vendor datasheets (dense)
PEAK_TFLOPS = {"H200": (989, 494), "H100": (989, 494), "A100": (312, 156), "L4": (121, 60),
               "A10": (125, 62), "V100": (125, 15.7), "4090": (165, 82.6)}
MiB = 2 ** 20


def cells(spec, backends, shards, worlds) -> list[tuple[str, dict | None, str]]:
    """(label, spec data or None, why skipped) for every combination."""
    out = []
    for backend in backends:
        for shard in shards or [spec.shard]:
            for world in worlds or [spec.world_size]:
                label = f"{backend}/{shard}/w{world}"
                data = {**spec.model_dump(mode="json", exclude_unset=True), "backend": backend,
                        "shard": shard, "topology": {"procs_per_node": world}}
                try:
                    out.append((label, load_spec(data).model_dump(mode="json"), ""))
                except SpecError as err:
                    out.append((label, None, "; ".join(f"{p}: {m}" for p, m in err.problems)))
    return out


def summarize(result: dict, warmup_free: list[float], precision: str) -> dict:
    times = sorted(warmup_free)
    median = statistics.median(times)
    p90 = times[min(len(times) - 1, int(round(0.9 * (len(times) - 1))))]
    ranks = result["ranks"]
    comm = {k: max(r["comm"]["bytes"].get(k, 0) for r in ranks)  # one counted step
            for k in ("all_gather", "reduce_scatter", "reduce", "all_reduce", "broadcast")}
    row = {"median_s": median, "p90_s": p90, "tokens_per_s": result["tokens_per_step"] / median,
           "loss_first": result["losses"][0], "loss_last": result["losses"][-1],
           "params_bytes": max(r["params_bytes"] for r in ranks),
           "grads_bytes": max(r["grads_bytes"] for r in ranks),
           "optimizer_bytes": max(r["optimizer_bytes"] for r in ranks),
           "rss_peak_bytes": max(r["rss_peak_bytes"] for r in ranks),
           "comm_bytes_per_step": comm, "mfu": mfu(result, median, precision)}
    return row


def mfu(result: dict, step_s: float, precision: str) -> float | None:
    """6N FLOPs per token (forward + backward) over the device's peak; None off GPUs."""
    name = result.get("device_name", "cpu")
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    if peak is None:
        return None
    flops = 6 * result["params"] * result["tokens_per_step"]
    tflops = peak[0] if precision in ("bf16", "fp16") else peak[1]
    return flops / step_s / (tflops * 1e12 * result["devices"])


NATIVE_DIR = Path(__file__).resolve().parents[3] / "benchmarks"
def run_native(cell_spec, options: dict, rows: int, out: Path, timeout: float) -> dict:
    """The same cell through its backend's hand-written loop in benchmarks/ (no polyshard in it)."""
    descriptor = get(cell_spec.backend)
    script = NATIVE_DIR / descriptor.native_loop
    args = [f"--{k}={v}" for k, v in options.items()] + [
        f"--global-rows={rows}", f"--clip={cell_spec.grad_clip or 0.0}", f"--seed={cell_spec.seed}",
        *descriptor.native_args(cell_spec)]
    return run_locally(cell_spec, str(script), args, out, timeout)


def bench(spec, backends, shards, worlds, options: dict, out_dir: Path, timeout: float = 600,
          status=None, vs_native: bool = False) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = spec.micro_batch_size * spec.grad_accum_steps * spec.world_size
    args = [f"--{k}={v}" for k, v in options.items()] + [f"--global-rows={rows}"]
    results = {}
    for label, data, why in cells(spec, backends, shards, worlds):
        if data is None:
            results[label] = {"skipped": why}
            continue
        if status is not None:
            status.update(f"bench {label}: fresh launch, {options['steps']} measured steps")
        cell_spec = load_spec({**data, "micro_batch_size": rows // data["topology"]["procs_per_node"]
                               // data["grad_accum_steps"]})
        raw = run_locally(cell_spec, "parallel.tools.bench.cell", args,
                          out_dir / f"raw-{label.replace('/', '_')}.json", timeout)
        results[label] = raw if "error" in raw else {**raw, **summarize(
            raw, raw["step_times"], cell_spec.precision)}
        results[label]["comm_counted"] = get(cell_spec.backend).comm_counted
        if vs_native and "error" not in raw:
            if status is not None:
                status.update(f"bench {label}: the native loop")
            native = run_native(cell_spec, options, rows,
                                out_dir / f"native-{label.replace('/', '_')}.json", timeout)
            results[label]["native"] = native if "error" in native else {
                "median_s": statistics.median(native["step_times"]), "losses": native["losses"]}
    (out_dir / "bench.json").write_text(json.dumps(results, indent=1))
    write_csv(results, out_dir / "bench.csv")
    return results


def write_csv(results: dict, path: Path) -> None:
    keys = ["median_s", "p90_s", "tokens_per_s", "loss_first", "loss_last", "params_bytes",
            "grads_bytes", "optimizer_bytes", "rss_peak_bytes", "mfu"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cell", *keys, "all_gather_B", "reduce_scatter_B", "all_reduce_B", "note"])
        for label, r in results.items():
            if "median_s" not in r:
                w.writerow([label, *[""] * (len(keys) + 3), r.get("skipped") or "error"])
                continue
            c = r["comm_bytes_per_step"]
            w.writerow([label, *[r[k] for k in keys], c["all_gather"], c["reduce_scatter"],
                        c["all_reduce"], ""])


def _vs_native(r: dict) -> str:
    native = r.get("native")
    if not native:
        return "-"
    if "error" in native:
        return "n/a"
    return f"{r['median_s'] / native['median_s']:.3f}"


def render(results: dict, out_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="polyshard bench (per rank: the largest over ranks)")
    for col in ("cell", "step ms (med / p90)", "tok/s", "loss", "params MiB", "grads MiB",
                "optim MiB", "RSS MiB", "AG / RS / AR MiB/step", "MFU", "x native"):
        table.add_column(col, justify="left" if col == "cell" else "right")
    for label, r in results.items():
        if "median_s" not in r:
            note = r.get("skipped") or "error: " + r.get("error", "")[-200:]
            table.add_row(label, f"[dim]{note[:90]}[/]", *[""] * 9)
            continue
        c = r["comm_bytes_per_step"]
        comm = "n/a (in-graph)" if not r.get("comm_counted", True) else " / ".join(
            f"{c[k] / MiB:.2f}" for k in ("all_gather", "reduce_scatter", "all_reduce"))
        table.add_row(label, f"{r['median_s'] * 1e3:.0f} / {r['p90_s'] * 1e3:.0f}",
                      f"{r['tokens_per_s']:.0f}", f"{r['loss_first']:.3f}→{r['loss_last']:.3f}",
                      f"{r['params_bytes'] / MiB:.2f}", f"{r['grads_bytes'] / MiB:.2f}",
                      f"{r['optimizer_bytes'] / MiB:.2f}", f"{r['rss_peak_bytes'] / MiB:.0f}",
                      comm, "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%", _vs_native(r))
    console = Console()
    console.print(table)
    figure = plot(results, out_dir)
    console.print(f"results: {out_dir / 'bench.json'}, {out_dir / 'bench.csv'}; figure: {figure}")
