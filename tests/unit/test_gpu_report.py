"""benchmarks/gpu_report.py, the GPU check's record: a step's outcome is written the moment it
ends (a run cut off later still reports it), a failure or a missing step fails `check` by name, and
bench's MFU counts FLOPs as the tracker and torchtitan do."""

import importlib.util
import json
from pathlib import Path

import pytest

from parallel.engine.observe.flops import peak_flops
from parallel.tools.bench.report import mfu

spec = importlib.util.spec_from_file_location(
    "gpu_report", Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_report.py")
gpu_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_report)


def test_each_step_is_on_record_as_it_ends_and_check_names_what_failed(tmp_path, capsys):
    out = tmp_path / "out"
    assert gpu_report.main(["record", "--out", str(out), "--step", "tests", "--what", "parity",
                            "--rc", "0", "--seconds", "3.5"]) == 0
    table = (out / "gpu_check.md").read_text()
    assert "| tests | parity | passed | 4 |" in table  # there before any later step ran
    gpu_report.main(["record", "--out", str(out), "--step", "bench", "--what", "1B", "--rc", "124",
                     "--bench", str(tmp_path / "none")])
    gpu_report.main(["record", "--out", str(out), "--step", "fp8", "--skip", "not built"])
    table = (out / "gpu_check.md").read_text()
    assert "| bench | 1B | timed out |" in table and "skipped: not built" in table
    assert json.loads((out / "gpu_check.json").read_text())["steps"][1]["cells"] == {}
    assert gpu_report.main(["check", "--out", str(out), "--expect", "tests,bench,fp8,save"]) == 1
    assert "bench: exit 124; save: missing" in capsys.readouterr().out
    assert not list(out.glob(".*.tmp"))


def test_goals_are_marked_with_their_figures():
    cells = {"fsdp2/full/w1": {"median_s": 1.0, "native": {"paired": [1.01, 1.0, 1.02]},
                               "mfu": 0.38, "peak_error": -0.12}}
    assert gpu_report.goals(cells) == [
        "fsdp2/full/w1: 1.010x native (met 1.02x)", "fsdp2/full/w1: MFU 38.0% (missed 40%)",
        "fsdp2/full/w1: plan's peak -12.0% of measured (missed ±10%)"]


def test_bench_mfu_counts_flops_per_token_as_the_tracker_does():
    """6 x non-embedding parameters + attention (what the cell records), not 6 x every parameter."""
    result = {"device_name": "NVIDIA H200", "params": 1_000, "flops_per_token": 4_000.0,
              "tokens_per_step": 8192, "devices": 1}
    assert mfu(result, 0.5, "bf16") == pytest.approx(4_000 * 8192 / 0.5 / peak_flops("H200", "bf16"))
    assert mfu(result, 0.5, "fp32") == pytest.approx(4_000 * 8192 / 0.5 / 67e12)
    assert mfu({**result, "device_name": "cpu"}, 0.5, "bf16") is None
