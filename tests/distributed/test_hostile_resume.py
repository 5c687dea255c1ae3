"""A real 2-rank resume (`checkpoint.resume: auto`, as after a restart) from a checkpoint whose
trainer state and RNG files were replaced by pickles that would run code, their hash tables
recomputed as an attacker would: the job stops naming the file, and nothing ran (docs/security.md)."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from harness import ROOT, torchrun

pytestmark = pytest.mark.distributed
BUDGET_S = 30  # seconds in make test (tests/conftest.py)
WORKER = ROOT / "tests" / "distributed" / "hostile_worker.py"


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# make test-full: tests/unit/test_hostile_files.py proves the same reader refusing planted pickles,
# links and FIFOs in an engine's load in one process
@pytest.mark.full
def test_planted_pickles_are_refused_on_resume(tmp_path):
    root, marker = tmp_path / "run", tmp_path / "PWNED"
    torchrun(2, [str(WORKER), "--phase", "save", "--root", str(root)], timeout=180)
    ckpt = root / (root / "latest").read_text().strip()
    for name in ("trainer.pt", "rng/rank0.pt", "rng/rank1.pt"):
        torch.save(Payload(marker), ckpt / name)
    for table in (ckpt / "hashes").glob("rank*.json"):  # the attacker recomputes the sha256 tables
        entries = json.loads(table.read_text())
        for name in entries:
            data = (ckpt / name).read_bytes()
            entries[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        table.write_text(json.dumps(entries))
    assert subprocess.run([sys.executable, "-m", "parallel.cli", "ckpt", "verify", str(root)],
                          cwd=ROOT, capture_output=True).returncode == 0  # hashes prove nothing
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), "--phase", "resume", "--root", str(root)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "USE_TORCH_XLA": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "trainer.pt" in out and "posix.system" in out, out[-3000:]
    assert not marker.exists(), "a planted pickle ran"
    assert json.loads((ckpt / "manifest.json").read_text())["step"] == 1  # nothing was saved over
