"""What the two conftests share about the suite's time budgets (tests/conftest.py enforces them):
where the shared launches (tests/distributed/shared.py) record their seconds."""

import contextlib
import time

import pytest

# (the file whose test started the shared launches, their seconds)
SHARED_SECONDS = pytest.StashKey[tuple]()
SHARED = "tests/distributed/(shared launches)"  # their line in the table, with a budget of its own
SHARED_BUDGET_S = 1100.0


@contextlib.contextmanager
def within(cpu_s: float, wall_s: float | None = None):
    """`with within(cpu_s):` a bounded piece of in-process work (a crafted file refused): the
    process's CPU seconds must stay under `cpu_s`, its wall seconds under `wall_s` (default
    10 x cpu_s). CPU seconds measure the work itself; wall seconds on a shared host measure the
    host too (CI's unit lane runs niced beside the multi-process tests: a 13 s validate took
    46 s of wall time there). The wall bound is what catches a read that blocks (a FIFO)."""
    wall_s = wall_s or 10 * cpu_s
    cpu, wall = time.process_time(), time.monotonic()
    yield
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    assert cpu < cpu_s, f"{cpu:.1f} CPU seconds, more than the {cpu_s} allowed"
    assert wall < wall_s, f"{wall:.1f} s of wall time, more than the {wall_s} allowed"
