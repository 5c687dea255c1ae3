"""`polyshard bench --startup`: seconds from a command's start to the end of its first training step,
`polyshard launch` of polyshard's job against torchrun of the backend's hand-written loop (benchmarks/),
in alternating pairs (a shared host drifts: adjacent runs see the same load)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parallel.registry import get
from parallel.spec.io import dump_spec
from parallel.tools.bench.report import NATIVE_DIR

# run as a script: its own directory (not bench/, whose profile.py would shadow the standard one)
JOB = Path(__file__).with_name("jobs") / "startup.py"


def _run(cmd: list[str], out: Path, timeout: float) -> float:
    """Seconds from starting `cmd` to the first-step end it wrote to `out`."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{' '.join(cmd[:6])}...: exit {proc.returncode}\n"
                           f"{(proc.stdout + proc.stderr)[-2000:]}")
    return json.loads(out.read_text())["first_step_end"] - start


def measure_startup(spec, model: str, seq: int, pairs: int = 5, timeout: float = 300) -> dict:
    """Median seconds to the first step for both sides, and the median of per-pair ratios."""
    native = get(spec.backend).bench.native(spec)
    if native is None:
        return {"skipped": f"backend {spec.backend!r} has no hand-written loop for this spec"}
    script, flags = native
    rows = spec.micro_batch_size * spec.grad_accum_steps * spec.dims.dp_size
    with tempfile.TemporaryDirectory(prefix="polyshard-startup-") as tmp:
        spec_file = Path(tmp) / "spec.yaml"
        spec_file.write_text(dump_spec(spec))
        ours_out, theirs_out = Path(tmp) / "ours.json", Path(tmp) / "native.json"
        ours_cmd = [sys.executable, "-P", "-m", "parallel.cli", "launch", str(spec_file), str(JOB),
                    f"--model={model}", f"--seq={seq}", f"--out={ours_out}"]
        theirs_cmd = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone",
                      "--nproc-per-node", str(spec.topology.procs_per_node),
                      str(NATIVE_DIR / script), f"--model={model}", f"--seq={seq}",
                      f"--global-rows={rows}", "--warmup=0", "--steps=1", "--startup",
                      f"--out={theirs_out}", *flags]
        ours, theirs = [], []
        for _ in range(pairs):
            ours.append(_run(ours_cmd, ours_out, timeout))
            theirs.append(_run(theirs_cmd, theirs_out, timeout))
    return {"polyshard_s": statistics.median(ours), "native_s": statistics.median(theirs),
            "ratio": statistics.median(o / t for o, t in zip(ours, theirs)), "pairs": pairs,
            "native": script}
