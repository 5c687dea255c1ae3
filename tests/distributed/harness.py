"""Launch a job's ranks (a parity worker, a suite worker), bounded by a timeout, and read back its results."""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("parity_worker.py")


def needs(*modules: str):
    """Skip one test, with the reason, when a backend's dependency is neither installed nor in a
    lane of its own (POLYSHARD_PYTHON_XLA: parallel/launch/lanes.py), never a whole file: its tests
    that need neither still run."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None and lane(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (pip install "
                              f"'polyshard[{','.join(m.replace('torch_', '') for m in missing)}]', "
                              "or name its lane's python: POLYSHARD_PYTHON_XLA)")


def lane(module: str) -> str | None:
    """The Python of the lane holding `module` where it is not installed here (torch_xla, in
    .venv-xla beside the main lane's torch), else None."""
    from parallel.launch.lanes import lane_of

    return lane_of(module)


def python_for(env: dict | None) -> str:
    """The interpreter of a launch: XLA's (USE_TORCH_XLA=1, as the backend's launch sets it) from
    its lane where torch_xla lives apart, everything else this one."""
    return (lane("torch_xla") or sys.executable) if (env or {}).get("USE_TORCH_XLA") == "1" \
        else sys.executable


needs_xla = needs("torch_xla")
needs_deepspeed = needs("deepspeed")
needs_both = needs("deepspeed", "torch_xla")
ROOT = Path(__file__).resolve().parents[2]


# A rank of a gloo job on this 2-core box occasionally dies in C++ with this, at start-up or at
# exit, whatever the job (measured: DeepSpeed's start-up in test_checkpoint_memory.py at 97e0db9,
# torch's own pipeline schedules in pipeline_v_worker.py in CI at a6f7fbf; each passed on its next
# run). Such a launch is run once more, saying so (recorded: reliability.RELAUNCHED, which the
# run's summary lists); a second abort, or any other failure, fails.
ABORT = "terminate called without an active exception"


def torchrun(nproc: int, args: list[str], timeout: float = 240, env: dict | None = None):
    """`python args` as `nproc` ranks of one job, started as torchrun --standalone starts its
    workers but without its agent process (parallel/launch/ranks.py: 4 s less a launch); the
    first rank to fail ends the others. Asserts every rank exited 0; returns the ranks' output."""
    try:
        return _launch(nproc, args, timeout, env)
    except AssertionError as err:
        if not str(err).startswith("exit -6 ") or ABORT not in str(err):
            raise
        import reliability

        print(f"harness: a rank aborted ('{ABORT}'); launching once more: {' '.join(args)[:200]}",
              file=sys.stderr)
        reliability.record(f"{reliability.RELAUNCHED}-{time.time_ns()}", {
            "command": " ".join(map(str, args))[:300], "ranks": nproc,
            "first_run": str(err).splitlines()[0]})
        return _launch(nproc, args, timeout, env)


def _launch(nproc: int, args: list[str], timeout: float, env: dict | None):
    from parallel.launch.ranks import job_ranks, wait_ranks

    # the checkout first; a PYTHONPATH the caller set stays behind it (a GPU machine's packages
    # carried into a --target folder: docs/gpu.md)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "USE_TORCH_XLA": "0",
                "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONPATH": path, **(env or {})}
    cmd = [python_for(env), *args]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # each rank in a session of its own, so ending it ends what it started (a writer process)
        with job_ranks(cmd, nproc, full_env, cwd=ROOT, stdout=out, stderr=err,
                       start_new_session=True) as procs:
            failed, late = wait_ranks(procs, timeout)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if late:
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n{stdout[-4000:]}\n"
                             f"{stderr[-8000:]}")
    log = os.environ.get("POLYSHARD_LAUNCH_LOG")  # where a suite's launches go: seconds, command
    if log:
        with open(log, "a") as f:
            f.write(f"{time.perf_counter() - start:7.1f}  {nproc}  {' '.join(args)[:300]}\n")
    code = 0 if failed is None else procs[failed].returncode
    assert code == 0, f"exit {code} (rank {failed})\n{stdout[-4000:]}\n{stderr[-8000:]}"
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def run_parity(tmp: Path, cases: list[dict], nproc: int = 2, timeout: float = 240,
               env: dict | None = None):
    """Both phases, each a fresh launch; returns {case: {"train": ..., "resume": ...}}."""
    (tmp / "cases.json").write_text(json.dumps(cases))
    results = {}
    for phase in ("train", "resume"):
        out = tmp / f"{phase}.json"
        torchrun(nproc, [str(WORKER), "--cases", str(tmp / "cases.json"), "--phase", phase,
                         "--ckpt-root", str(tmp / "ckpt"), "--out", str(out)], timeout, env)
        for name, res in json.loads(out.read_text()).items():
            results.setdefault(name, {})[phase] = res
    return results


def parity_jobs(tmp: Path, cases: list[dict], nproc: int = 2, env: dict | None = None,
                key: str = "parity") -> list:
    """run_parity's two phases as jobs of the suite's shared launches (shared.py): train in phase
    1, resume in fresh processes in phase 2."""
    from shared import job

    (tmp / f"{key}-cases.json").write_text(json.dumps(cases))
    return [job("parity_worker", ["--cases", tmp / f"{key}-cases.json", "--phase", phase,
                                  "--ckpt-root", tmp / f"{key}-ckpt", "--out",
                                  tmp / f"{key}-{phase}.json"], nproc, env, number)
            for number, phase in ((1, "train"), (2, "resume"))]


def parity_results(tmp: Path, run, key: str = "parity") -> dict:
    """What parity_jobs' two phases wrote: {case: {"train": ..., "resume": ...}}."""
    from shared import read

    results = {}
    for phase in ("train", "resume"):
        for name, res in read(tmp / f"{key}-{phase}.json", run, "parity_worker").items():
            results.setdefault(name, {})[phase] = res
    return results


def check_launches(shared, module: str, launches, check) -> dict:
    """Each case of a module's parity launches (`launches`: (key, cases, nproc, env) as handed to
    parity_jobs) checked by `check(name, its results, the launch's results)`; {name: what it
    returned}."""
    worst = {}
    for key, chosen, _, _ in launches:
        results = parity_results(*shared[module], key=key)
        for one in chosen:
            worst[one["name"]] = check(one["name"], results[one["name"]], results)
    return worst


def accepted(one) -> bool:
    """A parity case's specs (and its resume spec) validate: a backend refuses what it does not
    run (unit-tested there), and its variant then has no such case."""
    from parallel.spec.io import SpecError, load_spec

    try:
        for spec in (one["spec"], one.get("resume_spec") or one["spec"]):
            load_spec(spec)
    except SpecError:
        return False
    return True


def tier_results(request, tmp_path, module: str, key: str, chosen: list[dict], launch,
                 tier: str) -> dict:
    """A tiered parity test's results: make test's (`tier` quick) from the module's jobs in the
    suite's shared launches (parity_jobs under `key`), make test-full's run here, each phase a
    launch like `launch` (a matrix case: its nproc and env)."""
    if tier == "quick":
        tmp, run = request.getfixturevalue("shared")[module]
        return parity_results(tmp, run, key=key)
    return run_parity(tmp_path, chosen, nproc=launch.nproc, timeout=500, env=launch.env)


def case(name, spec, optimizer="sgd", steps=5, save_at=3, **extra):
    return {"name": name, "spec": spec, "optimizer": optimizer, "steps": steps, "save_at": save_at,
            **extra}


def check_parity(name, res, tol=1e-5, norm_tol=1e-4, resume_tol=0.0):
    """fp32 losses within tol of the single-process run; the resumed steps identical (within
    resume_tol where a caller states why not)."""
    train, resume = res["train"], res["resume"]
    assert "error" not in train, f"{name} train:\n{train['error']}"
    assert "error" not in resume, f"{name} resume:\n{resume['error']}"
    diffs = [abs(a - b) for a, b in zip(train["loss"], train["ref_loss"])]
    assert len(diffs) == len(train["ref_loss"]) and max(diffs) <= tol, (
        f"{name}: losses {train['loss']} vs reference {train['ref_loss']} (max diff {max(diffs):.2e})")
    ndiffs = [abs(a - b) / max(1.0, b) for a, b in zip(train["norm"], train["ref_norm"])]
    if tol > 1e-5:  # a stated tolerance: what was measured beside it (docs/testing.md's figures)
        print(f"{name}: measured max |loss - fp32 reference| {max(diffs):.2e} (tolerance {tol:.0e}),"
              f" grad norm {max(ndiffs):.2e} (tolerance {norm_tol:.0e})")
    assert max(ndiffs) <= norm_tol, f"{name}: grad norms {train['norm']} vs {train['ref_norm']}"
    start = resume["start"]
    # engine.load(path, weights_only=True) before the full load: the weights, nothing else
    # (or, where the step's loss adds what evaluation leaves out, the run's own evaluation there)
    weights, seen = resume["weights_only"], train.get("eval_at_save", train["loss"][start])
    assert weights["step"] == 1 and abs(weights["loss"] - seen) <= max(tol, 1e-5), (
        f"{name}: weights-only load: step {weights['step']} (kept 1?), evaluated loss "
        f"{weights['loss']} vs the run's {seen} at step {start + 1}")
    assert len(resume["loss"]) == len(train["loss"][start:]) and all(
        abs(a - b) <= resume_tol for a, b in zip(resume["loss"], train["loss"][start:])), (
        f"{name}: resumed at step {start}: {resume['loss']} vs uninterrupted {train['loss'][start:]}")
    return max(diffs)
