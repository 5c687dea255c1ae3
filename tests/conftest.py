import os
import sys
from pathlib import Path

# accelerate/transformers would pick XLA (and print a PJRT warning) when torch_xla is installed.
os.environ.setdefault("USE_TORCH_XLA", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PJRT_DEVICE", "CPU")  # the suite runs on CPU; torch_xla would guess and warn
sys.path.insert(0, str(Path(__file__).parent))  # reliability.py

import reliability  # noqa: E402


def pytest_sessionstart(session):
    reliability.reset()


def pytest_sessionfinish(session, exitstatus):
    """What the fault and fuzz tests recorded in this run, as a report: runs/reliability.md
    (untracked). The tracked docs/reliability.md is rewritten only on request:
    POLYSHARD_UPDATE_DOCS=1 make test (and only when the fault tests ran)."""
    root = Path(__file__).resolve().parents[1]
    target = root / ("docs" if os.environ.get("POLYSHARD_UPDATE_DOCS") == "1" else "runs")
    target.mkdir(exist_ok=True)
    reliability.write_doc(target / "reliability.md")
