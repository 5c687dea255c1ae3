"""The device checks' record (benchmarks/gpu_check.sh, benchmarks/tpu_check.sh; --check names
which): each step's outcome and figures go into OUT/<check>.json and OUT/<check>.md the moment the
step ends, so a run cut off at the device machine's limit still reports every step before the cut.
Bench figures are read from the bench.json `polyshard bench` wrote and shown with bench's own wide
columns (parallel/tools/bench/table.py), so the device table and `bench --wide` cannot disagree.

    gpu_report.py env --out OUT [--check tpu_check]     # step (a): versions and devices
    gpu_report.py record --out OUT --step NAME --what TEXT (--rc N --seconds S [--bench DIR]
                         | --skip WHY)
    gpu_report.py check --out OUT --expect a,b,...      # exit 1 naming a step that failed or is missing
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's parallel/

# The goals of #63 the table marks: polyshard's step within 1.02x the native loop's, bf16 MFU at
# least 40% (torchtitan's recipe on the largest Llama that fits), plan's peak within 10%.
GOALS = {"x_native": 1.02, "mfu": 0.40, "plan_error": 0.10}
PACKAGES = ("torch", "torch_xla", "torch_tpu", "libtpu", "deepspeed", "transformers", "accelerate",
            "pydantic", "torchao", "peft", "datasets")


CHECK = "gpu_check"  # the check whose files these are (--check)
TITLES = {"gpu_check": "GPU check", "tpu_check": "TPU check"}


def load(out: Path) -> dict:
    path = out / f"{CHECK}.json"
    return json.loads(path.read_text()) if path.exists() else {"steps": []}


def write(out: Path, record: dict) -> None:
    """Both files replaced whole (written aside, then renamed): a reader never sees half of one."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in ((f"{CHECK}.json", json.dumps(record, indent=1)),
                       (f"{CHECK}.md", markdown(record))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def environment() -> dict:
    """Versions and devices as this Python sees them (the GPU machine's own torch, the packages
    carried at their pins)."""
    facts = {"python": platform.python_version(), "host": platform.node(),
             "packages": {}, "devices": [], "cuda": None, "driver": None}
    for name in PACKAGES:
        try:
            facts["packages"][name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            facts["packages"][name] = None
    import torch

    from parallel.kits.device import accelerator

    kind = accelerator()  # CUDA, or TorchTPU's tpu where torch-tpu is installed
    facts["accelerator"] = kind
    if kind:
        module = getattr(torch, kind)
        facts["devices"] = [module.get_device_name(i) for i in range(module.device_count())]
    if kind == "cuda":
        facts["cuda"] = torch.version.cuda
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            facts["driver"] = smi.stdout.split()[0] if smi.stdout.split() else None
        except (OSError, subprocess.TimeoutExpired):
            pass
    return facts


def bench_rows(bench_dir: Path) -> dict:
    """bench.json's cells as written, {} when the step ended before bench wrote it."""
    path = bench_dir / "bench.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def goals(cells: dict) -> list[str]:
    """Each cell's figures against #63's goals: met / missed, with the figure."""
    notes = []
    for name, r in cells.items():
        if "median_s" not in r:
            continue
        paired = (r.get("native") or {}).get("paired")
        if paired:
            met = "met" if paired[0] <= GOALS["x_native"] else "missed"
            notes.append(f"{name}: {paired[0]:.3f}x native ({met} {GOALS['x_native']}x)")
        if r.get("mfu") is not None:
            met = "met" if r["mfu"] >= GOALS["mfu"] else "missed"
            notes.append(f"{name}: MFU {100 * r['mfu']:.1f}% ({met} {100 * GOALS['mfu']:.0f}%)")
        if "peak_error" in r:
            met = "met" if abs(r["peak_error"]) <= GOALS["plan_error"] else "missed"
            notes.append(f"{name}: plan's peak {r['peak_error']:+.1%} of measured ({met} "
                         f"±{100 * GOALS['plan_error']:.0f}%)")
    return notes


def markdown(record: dict) -> str:
    from parallel.tools.bench.table import WIDE, wide_row

    lines = [f"# {TITLES[CHECK]}", ""]
    env = record.get("env")
    if env:
        versions = ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v)
        lines += [f"Devices: {', '.join(env['devices']) or 'none (CPU)'}; CUDA {env['cuda']}, driver "
                  f"{env['driver']}; Python {env['python']}; {versions}.", ""]
    lines += ["| step | what | result | seconds |", "|---|---|---|---|"]
    for s in record["steps"]:
        result = f"skipped: {s['skip']}" if s.get("skip") else "passed" if s["rc"] == 0 else (
            "timed out" if s["rc"] in (124, 137) else f"failed (exit {s['rc']})")
        lines.append(f"| {s['step']} | {s['what']} | {result} | {s.get('seconds', 0):.0f} |")
    for s in record["steps"]:
        cells = s.get("cells") or {}
        ran = {k: r for k, r in cells.items() if "median_s" in r}
        if not ran:
            continue
        lines += ["", f"## {s['step']}: {s['what']}", "", "| " + " | ".join(WIDE) + " |",
                  "|" + "---|" * len(WIDE)]
        lines += ["| " + " | ".join([k, *wide_row(r)]) + " |" for k, r in ran.items()]
        lines += [f"- {n}" for n in goals(ran)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["env", "record", "check"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--step")
    p.add_argument("--what", default="")
    p.add_argument("--rc", type=int, default=0)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--bench", type=Path)
    p.add_argument("--skip")
    p.add_argument("--expect", default="")
    p.add_argument("--check", default="gpu_check", choices=sorted(TITLES))
    a = p.parse_args(argv)
    global CHECK
    CHECK = a.check
    record = load(a.out)
    if a.action == "check":
        seen = {s["step"]: s for s in record["steps"]}
        bad = [f"{n}: " + ("missing" if n not in seen else f"exit {seen[n]['rc']}")
               for n in a.expect.split(",") if n and (n not in seen or seen[n]["rc"])]
        print(f"{CHECK}: " + ("; ".join(bad) or "every step passed or was skipped with its reason"))
        return 1 if bad else 0
    entry = {"step": a.step if a.action == "record" else "env", "what": a.what, "rc": a.rc,
             "seconds": a.seconds}
    if a.action == "env":
        record["env"] = environment()
        entry["what"] = a.what or "versions and devices"
    if a.skip:
        entry.update(skip=a.skip, rc=0)
    if a.bench:
        entry["cells"] = bench_rows(a.bench)
    record["steps"] = [s for s in record["steps"] if s["step"] != entry["step"]] + [entry]
    write(a.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
