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

import pytest  # noqa: E402

import reliability  # noqa: E402
from budgets import SHARED, SHARED_BUDGET_S, SHARED_SECONDS  # noqa: E402

# Each test file's time budget in `make test` (seconds: setup + call + teardown of its tests, as
# --durations reads them): a tests/distributed file states its own (BUDGET_S = N, module level), a
# unit file may; `make test` (POLYSHARD_BUDGETS=1) fails the run naming every file over its budget,
# so the 25-minute suite stays that way file by file. `make test-full` runs the full matrices
# (tests marked `full`) without budgets.
UNIT_BUDGET_S = 60.0
ENFORCED = os.environ.get("POLYSHARD_BUDGETS") == "1"
# A file fails the run only past this multiple of its budget: this host's speed swings by a third
# from hour to hour (docs/testing.md: like trees 21.7-32.7 min), and a file at 1.003x its budget
# failed a run whose every test passed (2026-11-27). A file that took on a new matrix is past it.
FAIL_AT = 1.5
LANE = os.environ.get("POLYSHARD_SUITE_LANE") == "1"  # one of tests/suite.py's two lanes


BUDGETS = pytest.StashKey[dict]()


def pytest_configure(config):
    config.stash[BUDGETS] = {}


def pytest_collection_modifyitems(session, config, items):
    budgets = config.stash[BUDGETS]
    for item in items:
        path = item.nodeid.split("::")[0]
        if path in budgets:
            continue
        declared = getattr(item.module, "BUDGET_S", None)
        if declared is None and "/distributed/" in path:
            raise pytest.UsageError(f"{path}: a multi-process test file states its time budget "
                                    "(BUDGET_S = seconds, module level; tests/conftest.py)")
        budgets[path] = float(declared if declared is not None else UNIT_BUDGET_S)


def pytest_sessionstart(session):
    if not LANE:  # tests/suite.py gave both lanes a fresh store of their own
        reliability.reset()


def file_seconds(config) -> dict[str, float]:
    """Every file's time: setup + call + teardown of its tests, from the run's reports (as
    --durations reads them); the shared launches' time apart from the file that started them."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    times: dict[str, float] = {}
    for reports in (reporter.stats.values() if reporter else ()):
        for report in reports:
            if hasattr(report, "duration") and hasattr(report, "nodeid"):
                path = report.nodeid.split("::")[0]
                times[path] = times.get(path, 0.0) + report.duration
    started, seconds = config.stash.get(SHARED_SECONDS, (None, 0.0))
    if seconds:
        times[started] = max(0.0, times.get(started, 0.0) - seconds)
        times[SHARED] = seconds
        config.stash[BUDGETS].setdefault(SHARED, SHARED_BUDGET_S)
    return times


def over_budget(config) -> dict[str, tuple[float, float]]:
    budgets = config.stash[BUDGETS]
    return {p: (s, budgets[p]) for p, s in file_seconds(config).items()
            if p in budgets and s > budgets[p]}


def failing(config) -> dict[str, tuple[float, float]]:
    return {p: (s, b) for p, (s, b) in over_budget(config).items() if s > FAIL_AT * b}


def pytest_sessionfinish(session, exitstatus):
    """What the fault and fuzz tests recorded in this run, as a report (tests/reliability.py; under
    tests/suite.py, once both lanes are done). Under POLYSHARD_BUDGETS=1 a file far over its budget
    fails the run."""
    if ENFORCED and failing(session.config) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if not LANE:
        reliability.write_doc(reliability.report_path(Path(__file__).resolve().parents[1]))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Every file's time (setup + call + teardown, from the run's reports, as --durations reads
    them) beside its budget, slowest first: the suite's 25-minute budget is kept file by file."""
    times = file_seconds(config)
    if not times:
        return
    budgets = config.stash[BUDGETS]
    terminalreporter.section("seconds per test file (budget)")
    for path, seconds in sorted(times.items(), key=lambda kv: -kv[1]):
        budget = budgets.get(path)
        flag = "  OVER BUDGET" if budget is not None and seconds > budget else ""
        terminalreporter.write_line(f"{seconds:8.1f}  ({budget or 0:6.0f})  {path}{flag}")
    terminalreporter.write_line(f"{sum(times.values()):8.1f}  total")
    relaunched = reliability.records(reliability.RELAUNCHED)  # harness.py's second runs
    if relaunched:
        terminalreporter.section("launches run again after a rank aborted (harness.ABORT)")
        for record in relaunched:
            terminalreporter.write_line(f"{record['ranks']} ranks: {record['command']} "
                                        f"({record['first_run']})")
    over = failing(config)
    if over and ENFORCED:
        terminalreporter.write_line(
            f"FAILED: over {FAIL_AT}x budget: " + "; ".join(
                f"{p} {s:.0f} s > {b:.0f} s" for p, (s, b) in sorted(over.items())) +
            " (make the file's launches share one, or move a full matrix to make test-full)",
            red=True)
