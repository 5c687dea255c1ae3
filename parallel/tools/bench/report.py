"""`polyshard bench CONFIG --backends fsdp,zero2,xla1 [--shard ...] [--world 2,4] [--vs-native]`.

Every cell (backend or variant x shard x world size) runs in a fresh launch from the same initial
weights and global batches (parallel/tools/bench/cell.py); with --vs-native, the same job through
the backend's hand-written loop in benchmarks/ too. Results: a line per cell as it runs, a table
(narrow by default, `--wide` for every column), `bench.json` and `bench.csv`, and a PNG figure.
"""

from __future__ import annotations

import csv
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from parallel.launch.torchrun import run_locally
from parallel.registry import get, local_run
from parallel.spec.io import SpecError, load_spec
from parallel.tools.cells import cell_data, fixed_by, merged

MiB = 2 ** 20


@dataclass
class Cell:
    """One combination to run: a backend or variant (fsdp, zero2, ...), shard and precision where
    --shard and --precision are axes for it, and the world size asked for."""

    name: str
    shard: str | None
    world: int
    data: dict | None  # the validated spec, or None when it does not validate
    why: str = ""
    devices: int | None = None  # SPMD: the devices its one process drives (the world asked for)
    precision: str | None = None  # when --precision is an axis (bf16,fp8)

    def label(self, devices: int) -> str:
        """Labelled with the devices it ran on (XLA v1 on a CPU host runs one, whatever was asked)."""
        return "/".join([self.name, *[a for a in (self.shard, self.precision) if a], f"w{devices}"])


def cells(spec, names, shards, worlds, precisions=()) -> list[Cell]:
    out = []
    for name in names:
        axis = [None] if "shard" in fixed_by(name) else (shards or [spec.shard])
        for shard, world, precision in ((s, w, p) for s in axis for w in worlds or [spec.world_size]
                                        for p in precisions or [None]):
            try:
                data, devices = _cell_spec(spec, name, shard, world, precision)
                out.append(Cell(name, shard, world, data, devices=devices, precision=precision))
            except SpecError as err:
                out.append(Cell(name, shard, world, None, "; ".join(
                    f"{p}: {m}" for p, m in err.problems), precision=precision))
    return out


def _cell_spec(spec, name: str, shard: str | None, world: int,
               precision: str | None = None) -> tuple[dict, int | None]:
    """The cell's spec at `world` ranks: one process per device, or, where one process drives a
    host's devices (SPMD: process_devices None), one process over `world` devices."""
    changes = {"topology": {"procs_per_node": world}, **({"shard": shard} if shard else {}),
               **({"precision": precision} if precision else {})}
    data = cell_data(spec, name, **changes)
    if precision not in (None, "fp8"):  # a bf16 cell beside fp8 ones: the float8 section is fp8's
        data.pop("float8", None)
    try:
        return load_spec(data).model_dump(mode="json"), None
    except SpecError:
        one = load_spec(merged(data, {"topology": {"procs_per_node": 1}}))
        if get(one.backend).launch.process_devices(one) is not None:
            raise
        return one.model_dump(mode="json"), world


def summarize(result: dict, warmup_free: list[float], precision: str) -> dict:
    times = sorted(warmup_free)
    median = statistics.median(times)
    p90 = times[min(len(times) - 1, int(round(0.9 * (len(times) - 1))))]
    ranks = result["ranks"]
    comm = {k: max(r["comm"]["bytes"].get(k, 0) for r in ranks)  # one counted step
            for k in ("all_gather", "reduce_scatter", "reduce", "all_reduce", "broadcast")}
    return {"median_s": median, "p90_s": p90, "tokens_per_s": result["tokens_per_step"] / median,
            "target_tokens_per_s": result.get("target_tokens_per_step", 0) / median,
            "loss_first": result["losses"][0], "loss_last": result["losses"][-1],
            "params_bytes": max(r["params_bytes"] for r in ranks),
            "grads_bytes": max(r["grads_bytes"] for r in ranks),
            "optimizer_bytes": max(r["optimizer_bytes"] for r in ranks),
            "rss_peak_bytes": max(r["rss_peak_bytes"] for r in ranks),
            "comm_bytes_per_step": comm, "mfu": mfu(result, median, precision)}


def mfu(result: dict, step_s: float, precision: str) -> float | None:
    """Model FLOPs per token as train/mfu and torchtitan count them (engine/observe/flops.py) over
    the device's dense peak in the compute dtype (fp8: bf16's, as torchtitan); None off GPUs."""
    from parallel.engine.observe.flops import peak_flops

    peak = peak_flops(result.get("device_name", "cpu"), precision)
    if peak is None:
        return None
    per_token = result.get("flops_per_token", 6 * result["params"])  # bench.json before it
    return per_token * result["tokens_per_step"] / step_s / (peak * result["devices"])


NATIVE_DIR = Path(__file__).resolve().parents[3] / "benchmarks"


def native_arg(cell_spec) -> list[str]:  # the backend's hand-written loop for this spec, flags
    native = get(cell_spec.backend).bench.native(cell_spec)
    return [] if native is None else [f"--native={' '.join([native[0], *native[1]])}"]


def bench(spec, names, shards, worlds, options: dict, out_dir: Path, timeout: float = 600,
          say=lambda line: None, vs_native: bool = False, profile: int = 0,
          save: bool = False, precisions=()) -> dict:
    """Run every cell in a fresh launch (and its native loop with `vs_native`); `say` gets one line
    as each cell starts and ends. Cells that launch identically on this host run once."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = spec.micro_batch_size * spec.grad_accum_steps * spec.dims.dp_size
    args = [f"--{k}={v}" for k, v in options.items()] + [f"--global-rows={rows}"]
    results, launched = {}, {}
    todo = cells(spec, names, shards, worlds, precisions)
    facts = _facts(options["model"], spec.wrap, spec.topology.tp, spec.topology.tp_plan)
    for i, c in enumerate(todo, 1):
        asked = c.label(c.world)
        if c.data is None:
            results[asked] = {"skipped": c.why}
            say(f"[{i}/{len(todo)}] {asked}: skipped ({c.why})")
            continue
        # the global rows over the cell's data-parallel ranks (a tp x cp group shares its rows)
        model_dims = load_spec(c.data).dims
        model_dims = model_dims.tp * model_dims.cp * model_dims.pp
        cell_spec = load_spec({**c.data, "micro_batch_size": max(1, rows * model_dims // c.world
                                                                 // c.data["grad_accum_steps"])})
        key = json.dumps(local_run(cell_spec, c.devices), sort_keys=True)
        if key in launched:
            say(f"[{i}/{len(todo)}] {asked}: launches as {launched[key]} on this host; not repeated")
            continue
        native = native_arg(cell_spec) if vs_native else []
        extra = [f"--save-dir={out_dir / ('saves-' + asked.replace('/', '_'))}"] if save else []
        if native and profile:  # parallel/tools/bench/profile.py: both sides, after the timed steps
            native += [f"--profile={profile}",
                       f"--profile-dir={out_dir / ('profile-' + asked.replace('/', '_'))}"]
        say(f"[{i}/{len(todo)}] {asked}: launching; {options['warmup']} warm-up + "
            f"{options['steps']} steps" + (", alternating with native" if native else
                                           ", no native loop for it" if vs_native else ""))
        raw = run_locally(cell_spec, "parallel.tools.bench.cell", args + native + extra,
                          out_dir / f"raw-{asked.replace('/', '_')}.json", timeout, c.devices)
        label = launched[key] = c.label(raw.get("devices", c.world))
        r = results[label] = raw if "error" in raw else {**raw, **summarize(
            raw, raw["step_times"], cell_spec.precision)}
        r.update(name=c.name, backend=cell_spec.backend, shard=cell_spec.shard, asked_world=c.world,
                 precision=cell_spec.precision,
                 comm_counted=get(cell_spec.backend).bench.comm_counted,
                 **peaks(r, cell_spec, facts, options))
        if r.get("native"):
            r["native"]["median_s"] = statistics.median(r["native"]["step_times"])
            r["native"]["paired"] = paired_ratio(r["step_times"], r["native"]["step_times"])
        say(f"[{i}/{len(todo)}] {label}: {done_line(r)}")
    (out_dir / "bench.json").write_text(json.dumps(results, indent=1))
    write_csv(results, out_dir / "bench.csv")
    return results


def _facts(model: str, wrap, tp: int = 1, tp_plan: dict | None = None):
    """plan's view of the model (shapes, config, largest unit), or None when it cannot be built on
    the meta device (then no planned peak is shown)."""
    from parallel.tools.facts import model_facts

    try:
        return model_facts(model, wrap, tp, tp_plan)
    except Exception:  # noqa: BLE001 - a factory that cannot build on meta: measured only
        return None


def peaks(r: dict, cell_spec, facts, options: dict) -> dict:
    """The tensors `polyshard plan` predicts per rank at the peak (no margin) beside the most this
    cell's ranks held (cell.py: one more step, measured), and the error of the prediction."""
    measured = [x["memory"] for x in r.get("ranks") or [] if x.get("memory")]
    if facts is None or not measured or len(measured) != len(r["ranks"]):
        return {}
    from parallel.tools.plan import predict

    shapes, cfg, unit = facts
    planned = predict(cell_spec, shapes, cfg, options["seq"], options.get("optimizer", "adamw"),
                      unit)
    peak = max(m["peak"] for m in measured)
    return {"peak_planned_bytes": planned.total, "peak_measured_bytes": peak,
            "peak_error": planned.total / peak - 1, "peak_by": measured[0]["by"],
            "state_planned_bytes": planned.state,
            "boundary_measured_bytes": max(m["boundary"] for m in measured)}


def done_line(r: dict) -> str:
    if "median_s" not in r:
        lines = r.get("error", "").strip().splitlines()
        return "error: " + (lines[-1][:200] if lines else "no output")
    line = f"{r['median_s'] * 1e3:.0f} ms/step, loss {r['loss_last']:.4f}"
    if "peak_error" in r:
        line += (f", peak {r['peak_measured_bytes'] / MiB:.1f} MiB/rank (plan "
                 f"{r['peak_planned_bytes'] / MiB:.1f}, {r['peak_error']:+.0%})")
    saves = (r.get("ranks") or [{}])[0].get("saves")
    if saves:
        line += f", save blocks {save_text(saves)}"
    if "median_s" in (r.get("native") or {}):
        line += (f", {vs_native(r, interval=True)}x native (native {r['native']['median_s'] * 1e3:.0f}"
                 " ms; per-step pairs, median and 90% interval)")
    return line


def save_text(saves: dict) -> str:
    """'save 0.30 s (1.02x native) / load 0.21 s (1.05x) / async 0.03 s' from saves.save_times."""
    text = f"save {saves['sync_s']:.2f} s"
    if "save_vs_native" in saves:
        text += f" ({saves['save_vs_native']:.2f}x native)"
    if "load_s" in saves:
        text += f" / load {saves['load_s']:.2f} s" + (
            f" ({saves['load_vs_native']:.2f}x)" if "load_vs_native" in saves else "")
    if "async_blocking_s" in saves:
        text += f" / async {saves['async_blocking_s']:.2f} s"
    if "save_gbps" in saves:
        text += (f"; {saves['bytes'] / 1e9:.2f} GB saved at {saves['save_gbps']:.2f} GB/s "
                 f"({saves['save_of_disk']:.0%} of the disk's direct write, "
                 f"{saves['disk_write_gbps']:.2f} GB/s), loaded at {saves['load_gbps']:.2f} GB/s "
                 f"({saves['load_of_disk']:.0%} of its cold read, {saves['disk_read_gbps']:.2f})")
    if "hf_s" in saves:
        text += (f"; Hugging Face weights {saves['hf_s']:.2f} s ({saves['hf_vs_dcp']:.2f}x a DCP "
                 f"save of the weights alone" + (f", {saves['hf_gbps']:.2f} GB/s" if "hf_gbps" in saves
                                                 else "") + ")")
    if "inflight_slowdown" in saves:
        text += (f"; steps while an async save writes {saves['inflight_slowdown']:+.0%} "
                 f"({saves['inflight_step_s'] * 1e3:.0f} ms against {saves['plain_step_s'] * 1e3:.0f},"
                 f" save blocked {saves['async_block_s'] * 1e3:.0f} ms)")
    return text


def paired_ratio(ours: list[float], theirs: list[float], draws: int = 2000) -> list[float]:
    """[median, 5th, 95th percentile] of polyshard's step time over the native step run next to it
    (same launch, adjacent in time: drift of a shared host cancels in each pair; a ratio of two
    medians over a 2-core host moved by 10% run to run). The interval is a seeded bootstrap."""
    pairs = [a / b for a, b in zip(ours, theirs)]
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(pairs, k=len(pairs))) for _ in range(draws))
    return [statistics.median(pairs), boot[int(0.05 * draws)], boot[int(0.95 * draws) - 1]]


def vs_native(r: dict, interval: bool = False) -> str:
    paired = (r.get("native") or {}).get("paired")
    if not paired:
        return "-"
    return f"{paired[0]:.3f}" + (f" ({paired[1]:.2f}-{paired[2]:.2f})" if interval else "")


def loss_gap(r: dict) -> float | None:
    """The largest |loss difference| between polyshard's steps and the native loop's."""
    native = r.get("native") or {}
    if "losses" not in native or len(native["losses"]) != len(r["losses"]):
        return None
    return max(abs(a - b) for a, b in zip(r["losses"], native["losses"]))


CSV_KEYS = ["median_s", "p90_s", "tokens_per_s", "target_tokens_per_s", "loss_first", "loss_last",
            "params_bytes",
            "grads_bytes", "optimizer_bytes", "rss_peak_bytes", "mfu", "peak_measured_bytes",
            "peak_planned_bytes", "peak_error"]

# --save's GB/s against the disk's, the Hugging Face save, and the steps run while an async save writes
SAVE_EXTRA = ("save_gbps", "load_gbps", "disk_write_gbps", "disk_read_gbps", "save_of_disk",
              "load_of_disk", "hf_s", "hf_vs_dcp", "hf_gbps", "inflight_slowdown", "async_block_s",
              "inflight_write_left_s")


def write_csv(results: dict, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cell", *CSV_KEYS, "all_gather_B", "reduce_scatter_B", "all_reduce_B",
                    "native_median_s", "x_native", "x_native_p5", "x_native_p95", "native_loss_gap",
                    "save_sync_s", "save_async_blocking_s", "save_async_total_s", "load_s",
                    "native_save_s", "native_load_s", *SAVE_EXTRA,
                    "first_step_s",
                    "compile_s", "compiled_units", "graphs", "graph_breaks", "recompiles", "note"])
        for label, r in results.items():
            if "median_s" not in r:
                w.writerow([label, *[""] * (len(CSV_KEYS) + 20 + len(SAVE_EXTRA)),
                            r.get("skipped") or "error"])
                continue
            c, native = r["comm_bytes_per_step"], r.get("native") or {}
            saves = (r.get("ranks") or [{}])[0].get("saves") or {}
            w.writerow([label, *[r.get(k, "") for k in CSV_KEYS], c["all_gather"], c["reduce_scatter"],
                        c["all_reduce"], native.get("median_s", ""),
                        *(native.get("paired") or ["", "", ""]),
                        "" if loss_gap(r) is None else loss_gap(r),
                        *[saves.get(k, "") for k in ("sync_s", "async_blocking_s", "async_total_s",
                                                     "load_s", "native_save_s", "native_load_s",
                                                     *SAVE_EXTRA)],
                        r.get("first_step_s", ""),
                        *[(r.get("compile") or {}).get(k, "") for k in
                          ("compile_s", "compiled", "graphs", "breaks", "recompiles")],
                        native.get("skipped", "")])
