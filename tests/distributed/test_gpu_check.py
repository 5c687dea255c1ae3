"""benchmarks/gpu_check.sh --dry and benchmarks/tpu_check.sh --dry: the device checks run end to end
on this CPU at tiny sizes, so the scripts a lent GPU or a TPU VM runs first cannot rot unseen
(test_gpu.py once named a removed helper for a week of CPU-only runs). Every step records its
outcome as it ends; every bench step leaves its cells with the figures the device table reports
(ms/step, x native, peak against plan, save blocking). make test-full: 2 min each on this box, over
what make test's 25 minutes had left after the move to torch 2.15 (docs/testing.md)."""

import json
import subprocess

import pytest
from harness import ROOT

pytestmark = [pytest.mark.distributed, pytest.mark.full]
BUDGET_S = 30  # seconds in make test (tests/conftest.py): make test-full's
STEPS = ["env", "tests", "bench", "plan", "nccl", "save", "fp8", "largest"]


def test_gpu_check_runs_every_step_on_cpu(tmp_path):
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = {s["step"]: s for s in record["steps"]}
    assert list(steps) == STEPS, list(steps)
    assert record["env"]["packages"]["torch"] and record["env"]["devices"] == []
    # on a CPU test_gpu.py is collected and skipped with its reason, which the log keeps
    assert "needs CUDA and NCCL" in (tmp_path / "tests.log").read_text()
    for name in ("bench", "plan", "nccl", "save", "fp8", "largest"):
        assert steps[name]["rc"] == 0 and not steps[name].get("skip"), steps[name]
        cells = steps[name]["cells"]
        assert cells and all("median_s" in c and c["flops_per_token"] > 0 for c in cells.values())
    bench = steps["bench"]["cells"]["fsdp2/full/w1"]
    assert bench["native"]["paired"] and bench["mfu"] is None  # no peak is guessed for a CPU
    assert "peak_error" in steps["plan"]["cells"]["fsdp2/full/w1"]
    assert steps["nccl"]["cells"]["fsdp2/full/w2"]["world_size"] == 2
    saves = steps["save"]["cells"]["fsdp2/full/w1"]["ranks"][0]["saves"]
    assert saves["async_blocking_s"] < saves["sync_s"] and "inflight_slowdown" in saves
    table = (tmp_path / "gpu_check.md").read_text()
    assert all(f"| {name} |" in table for name in STEPS) and "x native" in table


def test_tpu_check_runs_every_step_on_cpu(tmp_path):
    """TorchTPU's check at topology.device cpu on 2 gloo ranks: test_tpu.py is collected and
    skipped with its reason; bench, save and the compiled step leave their cells."""
    proc = subprocess.run(["bash", "benchmarks/tpu_check.sh", "--dry", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    record = json.loads((tmp_path / "tpu_check.json").read_text())
    steps = {s["step"]: s for s in record["steps"]}
    assert list(steps) == ["env", "tests", "bench", "save", "compiled"], list(steps)
    assert "needs TorchTPU's tpu device" in (tmp_path / "tests.log").read_text()
    for name in ("bench", "save", "compiled"):
        cell = steps[name]["cells"]["fsdp2/full/w2"]
        assert steps[name]["rc"] == 0 and cell["world_size"] == 2 and "median_s" in cell, cell
    assert "async_blocking_s" in steps["save"]["cells"]["fsdp2/full/w2"]["ranks"][0]["saves"]
    assert "| compiled |" in (tmp_path / "tpu_check.md").read_text()
