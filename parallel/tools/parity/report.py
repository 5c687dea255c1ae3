"""`polyshard parity CONFIG --backends fsdp,deepspeed,xla_fsdp`: the same job on every backend, checked.

Each backend runs in a fresh launch from the same initial weights on the same global batches; a plain
single-process PyTorch run of that job is the reference. Per step it prints every backend's loss,
gradient norm and weight checksum next to the reference, and exits 1 when any loss is further from it
than the tolerance (1e-5 in fp32): the comparison users otherwise do by hand.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from parallel.launch.torchrun import run_locally
from parallel.tools.parity.cell import global_batches, one_process, plain_optimizer
from parallel.spec.model import Spec
from parallel.spec.io import SpecError, load_spec
from parallel.tools.cells import cell_data
from parallel.toy import build_model

FP32_TOL, MIXED_TOL = 1e-5, 5e-2
# Muon's Newton-Schulz runs in bf16: a gradient off in its last fp32 bits (the sum's order over
# ranks) now and then rounds to another bf16 value; measured at most 1.04e-4 (tp 2) on CPU
# backends (docs/optimizers.md)
MUON_TOL = 2e-4


def reference(spec: Spec, options: dict, rows: int) -> list[dict]:
    """One process, the whole global batch, plain PyTorch: what every backend must reproduce."""
    # transformers would otherwise import torch_xla (when installed) for a plain CPU run
    os.environ.setdefault("USE_TORCH_XLA", "0")
    torch.manual_seed(spec.seed)
    model = build_model(options["model"])
    batches = global_batches(options["steps"], rows, options["seq"], model.config.vocab_size,
                             spec.seed)
    return one_process(model, plain_optimizer(options["optimizer"], options["lr"]), batches,
                       spec.grad_clip, checksums=True)


def run_backend(spec: Spec, name: str, options: dict, rows: int, timeout: float) -> dict:
    """Backend or variant `name` (fsdp1, zero2, ...) on the spec's job, in a fresh launch."""
    run_spec = load_spec(cell_data(spec, name))
    args = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()] + [f"--global-rows={rows}"]
    with tempfile.TemporaryDirectory(prefix="polyshard-parity-") as tmp:
        result = run_locally(run_spec, "parallel.tools.parity.cell", args, Path(tmp) / "out.json", timeout)
    if "error" not in result:
        result["launch"] = (f"{result['procs']} process(es), micro_batch_size "
                            f"{result['micro_batch_size']}")
    return result


def compare(ref: list[dict], runs: dict[str, dict], tol: float) -> dict[str, dict]:
    """Per backend: the largest differences from the reference, and whether the loss is within tol."""
    summary = {}
    for name, run in runs.items():
        if "error" in run:
            summary[name] = {"ok": False, "error": run["error"]}
            continue
        diffs = {key: max(abs((s[key] or 0.0) - (r[key] or 0.0)) for s, r in zip(run["steps"], ref))
                 for key in ("loss", "grad_norm", "checksum")}
        summary[name] = {"ok": diffs["loss"] <= tol and len(run["steps"]) == len(ref), **diffs}
    return summary


def render(ref: list[dict], runs: dict[str, dict], summary: dict, tol: float) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"parity against one process (loss tolerance {tol:g})")
    for column in ("step", "run", "loss", "|Δ loss|", "grad norm", "checksum", "|Δ checksum|"):
        table.add_column(column, justify="right" if column != "run" else "left")
    for i, r in enumerate(ref):
        table.add_row(str(i + 1), "reference", f"{r['loss']:.7f}", "", f"{r['grad_norm']:.6f}",
                      f"{r['checksum']:.6f}", "")
        for name, run in runs.items():
            if "error" in run:
                continue
            s = run["steps"][i]
            norm = "-" if s["grad_norm"] is None else f"{s['grad_norm']:.6f}"
            table.add_row("", name, f"{s['loss']:.7f}", f"{abs(s['loss'] - r['loss']):.1e}", norm,
                          f"{s['checksum']:.6f}", f"{abs(s['checksum'] - r['checksum']):.1e}")
        table.add_section()
    console = Console()
    console.print(table)
    for name, result in summary.items():
        if "error" in result:
            console.print(f"[red]{name}: failed to run[/]\n{escape(result['error'])}")  # its
            # own brackets (gloo's "[/path...]") are text, not rich tags
        else:
            mark = "[green]ok[/]" if result["ok"] else "[red]BEYOND TOLERANCE[/]"
            console.print(f"{name} ({runs[name]['launch']}): max |Δ loss| {result['loss']:.2e}, "
                          f"|Δ grad norm| {result['grad_norm']:.2e}, |Δ checksum| "
                          f"{result['checksum']:.2e}  {mark}")


def parity(spec: Spec, backends: list[str], options: dict, tol: float | None = None,
           timeout: float = 600, output: str | None = None) -> int:
    if spec.topology.nodes != 1:
        raise SpecError([("topology.nodes", f"{spec.topology.nodes}: parity runs every backend on "
                          "this host; use nodes: 1")])
    if tol is None:
        tol = FP32_TOL if spec.compute == "fp32" else MIXED_TOL
        tol = max(tol, MUON_TOL) if options["optimizer"] == "muon" else tol
    rows = spec.micro_batch_size * spec.grad_accum_steps * spec.dims.dp_size
    from rich.console import Console

    with Console(stderr=True).status("reference: one process, plain PyTorch") as status:
        ref = reference(spec, options, rows)
        runs = {}
        for b in backends:  # one at a time: each launch has the host's cores to itself
            status.update(f"{b}: training {options['steps']} steps in a fresh launch")
            runs[b] = run_backend(spec, b, options, rows, timeout)
    summary = compare(ref, runs, tol)
    render(ref, runs, summary, tol)
    if output:
        Path(output).write_text(json.dumps({"reference": ref, "runs": runs, "summary": summary,
                                            "tolerance": tol}, indent=1))
    return 0 if all(r["ok"] for r in summary.values()) else 1
