"""`make test`'s two lanes at once: tests/distributed in the foreground, tests/unit beside it at a
lower CPU priority, each a pytest session of its own; then the unit lane's report, and one exit code.

Why: on CI's 2-core host the multi-process tests keep both cores busy only part of the time (start-up
imports, single-process phases, launches waiting on a signal or a timeout: 70% of both cores over a
whole run, measured with vmstat), and the unit tests, run after them, kept one core busy for their 4
minutes. Niced (POLYSHARD_UNIT_NICE, default 10) the unit lane takes what the multi-process lane
leaves idle and little of what it uses. Both lanes write their reliability figures into one store;
the report is written once both are done (tests/reliability.py).

    python tests/suite.py [pytest options]      # both lanes
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE_MINUTES = 25  # CI's budget for make test (README)


def lane(args: list[str], where: str, env: dict, log=None, nice: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pytest", *args, where], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT if log else None,
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)


def main(args: list[str]) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    import reliability

    start = time.perf_counter()
    store = tempfile.mkdtemp(prefix="polyshard-reliability-")
    env = {**os.environ, "POLYSHARD_RELIABILITY_DIR": store, "POLYSHARD_SUITE_LANE": "1"}
    nice = int(os.environ.get("POLYSHARD_UNIT_NICE", "10"))
    with tempfile.TemporaryFile("w+") as log:
        # the unit lane's file budgets are not enforced: niced, its files take what is left
        unit = lane(args, "tests/unit", {**env, "POLYSHARD_BUDGETS": "0"}, log, nice)
        distributed = lane(args, "tests/distributed", env).wait()
        units = unit.wait()
        log.seek(0)
        print(f"\n{'=' * 30} tests/unit (beside tests/distributed, nice {nice}) {'=' * 30}")
        print(log.read(), flush=True)
    reliability.write_doc(reliability.report_path(ROOT), Path(store))
    shutil.rmtree(store, ignore_errors=True)
    minutes = (time.perf_counter() - start) / 60
    print(f"make test: {minutes:.1f} min for both lanes (CI's budget: {SUITE_MINUTES} min); "
          f"tests/distributed exit {distributed}, tests/unit exit {units}")
    return distributed or units


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
