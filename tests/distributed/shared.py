"""The suite's shared launches: every test module's worker jobs that launch alike, in one launch per
(phase, layout) for the whole session, instead of one launch per module and layout.

A start-up is 6 s for two gloo ranks (torch, transformers, DeepSpeed imported) and more for XLA's CPU
client, which also compiles the same tiny models' graphs again in every process; the suite's
cross-backend tests ran 83 launches of their workers. A module declares its jobs with a module-level
`shared_jobs(tmp: Path) -> list[Job]` (writing whatever case files they read into `tmp`); the session's
`shared` fixture (tests/distributed/conftest.py) gathers them from every collected module at first use,
runs phase 1 of every layout, then phase 2 (fresh processes: a resume in phase 2 loads what phase 1
saved), and hands each module its `tmp`, where its jobs wrote their --out files as before.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from harness import ROOT, torchrun

WORKER = ROOT / "tests" / "distributed" / "suite_worker.py"
# what the harness gives every launch anyway: the layouts that differ only in it are one
DEFAULT_ENV = {"USE_TORCH_XLA": "0", "OMP_NUM_THREADS": "1"}
SINGLE_AT_ONCE = 2  # single-process launches run in pairs (Shared.run)


@dataclass(frozen=True)
class Job:
    worker: str  # a worker module of tests/distributed (it writes its own --out)
    argv: tuple[str, ...]  # its command line
    nproc: int
    env: tuple = ()  # sorted (name, value) items of the launch's environment
    phase: int = 1  # phase 2 runs after every phase-1 launch, in fresh processes

    @property
    def layout(self) -> tuple:
        return self.nproc, tuple(sorted({**DEFAULT_ENV, **dict(self.env)}.items()))


def job(worker: str, argv, nproc: int, env: dict | None = None, phase: int = 1) -> Job:
    return Job(worker, tuple(str(a) for a in argv), nproc, tuple(sorted((env or {}).items())), phase)


@dataclass
class Shared:
    """What ran: each launch's seconds and, for a launch that failed, its output (the jobs after the
    failing one wrote nothing)."""

    root: Path
    launches: list[dict] = field(default_factory=list)

    def run(self, jobs: list[Job]) -> None:
        for phase in sorted({j.phase for j in jobs}):
            layouts: dict[tuple, list[Job]] = {}
            for j in jobs:
                if j.phase == phase:
                    layouts.setdefault(j.layout, []).append(j)
            named = [(f"phase{phase}-{len(self.launches) + i}", layout, group)
                     for i, (layout, group) in enumerate(layouts.items())]
            # Multi-process layouts one at a time: their ranks fill both cores. Then the
            # single-process ones (XLA's CPU client) two at a time: one such process keeps 1.3
            # cores busy on average, so a pair ran in 159 s against 210 s one after the other
            # (docs/testing.md). Beside a 2-rank launch an XLA one ran 3-6x slower: not mixed.
            for name, layout, group in named:
                if layout[0] > 1:
                    self._launch(name, phase, layout, group)
            with ThreadPoolExecutor(max_workers=SINGLE_AT_ONCE) as pool:
                for done in [pool.submit(self._launch, name, phase, layout, group)
                             for name, layout, group in named if layout[0] == 1]:
                    done.result()

    def _launch(self, name: str, phase: int, layout: tuple, group: list[Job]) -> None:
        nproc, env = layout
        (self.root / f"{name}.json").write_text(json.dumps(
            [{"worker": j.worker, "argv": list(j.argv)} for j in group]))
        start, error = time.perf_counter(), None
        try:
            torchrun(nproc, [str(WORKER), "--jobs", str(self.root / f"{name}.json")],
                     timeout=1500, env=dict(env))
        except AssertionError as err:  # the jobs' tests fail on their missing output, with this
            error = str(err)[-6000:]
        self.launches.append({"name": name, "phase": phase, "nproc": nproc, "env": dict(env),
                              "jobs": [j.worker for j in group], "error": error,
                              "seconds": round(time.perf_counter() - start, 1)})

    def error_for(self, worker: str) -> str | None:
        """The output of a failed launch that held a job of `worker`, to name in a test's failure."""
        return next((launch["error"] for launch in self.launches
                     if launch["error"] and worker in launch["jobs"]), None)


def read(path: Path, shared: Shared | None, worker: str) -> dict:
    """A job's --out, or an assertion naming why it is missing (its launch's output). `shared`:
    None for a launch of the test's own."""
    if not path.is_file():
        why = shared.error_for(worker) if shared is not None else None
        raise AssertionError(f"{path.name}: no output from {worker}\n"
                             f"{why or '(its launch did not fail)'}")
    return json.loads(path.read_text())
