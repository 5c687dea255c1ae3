import os
import sys
from pathlib import Path

# accelerate/transformers would pick XLA (and print a PJRT warning) when torch_xla is installed.
os.environ.setdefault("USE_TORCH_XLA", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PJRT_DEVICE", "CPU")  # the suite runs on CPU; torch_xla would guess and warn
# XLA's CPU client spends most of an XLA test in LLVM, optimising tiny graphs that then run in
# milliseconds (the zoo's XLA v1 launch: 30.5 s compiling 32 graphs, 0.13 s executing them). Without
# LLVM's optimisation passes it compiles in 14.0 s and every loss stays within 1.5e-6 of the
# single-process reference (docs/xla.md). The suite only: users' jobs keep XLA's defaults.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                      "--xla_llvm_disable_expensive_passes=true")
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



def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Every file's time (setup + call + teardown, from the run's reports, as --durations reads
    them), slowest first: the suite's 35-minute budget is kept file by file."""
    times: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if hasattr(report, "duration") and hasattr(report, "nodeid"):
                path = report.nodeid.split("::")[0]
                times[path] = times.get(path, 0.0) + report.duration
    if not times:
        return
    terminalreporter.section("seconds per test file")
    for path, seconds in sorted(times.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(times.values()):8.1f}  total")
