"""`polyshard parity` end to end: every backend trained in its own launch against one process; exit 0
with every fp32 loss within 1e-5 (the exit-1 logic: tests/unit/test_parity_logic.py)."""

import json
import subprocess
import sys

import pytest
from harness import ROOT, needs_both

pytestmark = pytest.mark.distributed
BUDGET_S = 75  # seconds in make test (tests/conftest.py)


def parity(tmp_path, *args):
    out = tmp_path / "parity.json"
    proc = subprocess.run([sys.executable, "-m", "parallel.cli", "parity", "configs/demo.yaml",
                           "--steps", "3", "--json", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    return proc, (json.loads(out.read_text()) if out.is_file() else None)


@needs_both
@pytest.mark.timeout(700)
def test_all_backends_match_one_process(tmp_path):
    proc, result = parity(tmp_path, "--backends", "fsdp,deepspeed,xla_fsdp")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert set(result["summary"]) == {"fsdp", "deepspeed", "xla_fsdp"}
    for name, summary in result["summary"].items():
        assert summary["ok"] and summary["loss"] <= 1e-5, (name, summary)
        assert len(result["runs"][name]["steps"]) == 3
    assert result["runs"]["xla_fsdp"]["world_size"] == 1  # the CPU client: whole batch, one rank
    assert "max |Δ loss|" in proc.stdout
