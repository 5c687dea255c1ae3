"""Real faults, injected: non-finite losses and malformed batches on every backend, a SIGKILLed worker
under `polyshard launch --max-restarts 2`, a rank SIGKILLed in the middle of a save, a stalled rank.
Each outcome is recorded for docs/reliability.md."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import matrix
import pytest
from harness import ROOT, needs_both
from shared import job, read
from parallel import registry
from parallel.tools.cells import merged
from reliability import record

pytestmark = pytest.mark.distributed
BUDGET_S = 175  # seconds in make test (tests/conftest.py)

DIST = ROOT / "tests" / "distributed"
TWO = {"topology": {"procs_per_node": 2}, "micro_batch_size": 2}
CASES = matrix.cases(world=2, micro_batch_size=2)  # the tier's variants (matrix.py)


def shared_jobs(tmp):
    """This module's launches that share the suite's (shared.py): the step faults and the
    preemption of every variant, one per launch group, and the references of the jobs relaunched
    through `polyshard launch`."""
    jobs = []
    for group in matrix.by_launch(CASES):
        name = group[0].name
        (tmp / f"faults-{name}.json").write_text(json.dumps({c.name: c.spec for c in group}))
        jobs.append(job("fault_worker", ["--cases", tmp / f"faults-{name}.json",
                                         "--out", tmp / f"faults-{name}-out.json"],
                        group[0].nproc, group[0].env))
    for name, group, cases in preempted_groups(tmp):
        (tmp / f"preempt-{name}.json").write_text(json.dumps(cases))
        jobs.append(job("elastic_worker", ["--preempt", tmp / f"preempt-{name}.json",
                                           "--out", tmp / f"preempt-{name}-out.json"],
                        group[0].nproc, group[0].env))
    for name, group, specs in reference_groups(tmp):
        (tmp / f"references-{name}.json").write_text(json.dumps(specs))
        jobs.append(job("elastic_worker", ["--references", tmp / f"references-{name}.json",
                                           "--out", tmp / f"references-{name}-out.json"],
                        group[0].nproc, group[0].env))
    return jobs


@needs_both
@pytest.mark.timeout(900)
def test_nonfinite_loss_and_bad_batches_on_every_backend(shared):
    tmp, run = shared[__name__]
    results = {}
    for group in matrix.by_launch(CASES):
        results.update(read(tmp / f"faults-{group[0].name}-out.json", run, "fault_worker"))
    rows = []
    for backend in [c.name for c in CASES]:
        nonfinite = results[f"{backend}/nonfinite"]
        assert "error" not in nonfinite, nonfinite["error"]
        skipped = nonfinite["skip_losses"][3:]
        assert skipped == nonfinite["clean_losses"][2:], (backend, nonfinite)  # nothing moved
        assert nonfinite["skip_stepped"] == [True, True, False, True, True]
        assert nonfinite["raise"].startswith(
            "NonFiniteLossError at step 3: step 3: non-finite loss on rank"), nonfinite["raise"]
        deferred = nonfinite["deferred"]  # found at a later step's start, naming step 3
        assert deferred.startswith("NonFiniteLossError at step ") and \
            ": step 3: non-finite loss (the mean over ranks" in deferred, deferred
        assert "this rank's own loss was" in deferred
        assert nonfinite["deferred_save"].startswith("NonFiniteLossError at step 4: step 3:"), \
            nonfinite["deferred_save"]
        saved = [p for g in matrix.by_launch(CASES)
                 for p in tmp.glob(f"faults-{g[0].name}-out-{backend}-save/**/*")]
        assert not saved, saved  # the refused save wrote nothing, not even its folder's files
        found = int(deferred.split()[3].rstrip(":"))
        rows += [{"fault": "NaN loss, on_nonfinite: skip", "backend": backend,
                  "outcome": "step skipped; steps 4-5 equal a run without it"},
                 {"fault": "NaN loss, on_nonfinite: raise", "backend": backend,
                  "outcome": nonfinite["raise"][:90] + "..."},
                 {"fault": "NaN loss, on_nonfinite: raise_deferred", "backend": backend,
                  "outcome": f"raised at step {found}, naming step 3; save after step 3 refused"}]
        bad = results[f"{backend}/badbatch"]
        for fault, needle in (("missing_labels", "missing ['labels']"), ("empty", "empty batch"),
                              ("float_ids", "torch.float32")):
            errors = bad[fault]["errors"]
            last = len(errors) - 1
            assert errors[last].startswith(f"BatchError: step 2: rank {last}: ") and \
                needle in errors[last], bad
            assert all(e == "no error" for e in errors[:last]), errors
            assert bad[fault]["next_step"] == 2, bad  # the good step after it, taken together
            rows.append({"fault": f"bad batch: {fault}", "backend": backend,
                         "outcome": f"BatchError on rank {last} before any collective; the "
                         "ranks' next step together succeeds"})
    record("faults-step", {"summary": f"{len(rows)} faults injected, {len(rows)} handled as stated",
                           "rows": rows})


def launch(spec_file, log, *extra, timeout=240, env=None, restarts=0):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "parallel.cli", "launch", "--max-restarts",
                           str(restarts), str(spec_file),
                           str(DIST / "elastic_worker.py"), "--log", str(log), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    return proc, time.perf_counter() - start


def losses(log):
    last = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        last[entry["step"]] = entry["loss"]  # a restarted step's loss replaces the first attempt's
    return [last[s] for s in sorted(last)]


def spec(tmp, name, timeout_s=60, **changes):
    path = tmp / f"{name}.yaml"
    checkpoint = {"dir": str(tmp / name), "every": 2, "resume": "auto", "keep_last": 3,
                  **changes.get("checkpoint", {})}
    path.write_text(json.dumps({"backend": "fsdp", **TWO, **changes, "timeout_s": timeout_s,
                                "checkpoint": checkpoint}))
    return path


def preempted_cases() -> dict:
    """name: (case, which rank signals itself: -1 every rank). Every variant of the tier
    (matrix.py) with one rank signalled (the last), the first with every rank signalled, and XLA
    v2 on TPU VM slices, where torch_xla's preemption sync manager agrees instead of the loss
    reduction (its own feature: make test-full's)."""
    out = {c.name: (c, c.nproc - 1) for c in CASES}
    first = CASES[0]
    out[f"{first.name}-every-rank"] = (first, -1)
    xla2 = next((c for c in matrix.cases(world=2, micro_batch_size=2, every=True)
                 if c.name == "xla2"), None) if matrix.FULL else None
    if xla2 is not None:
        sync = merged(xla2.spec, {"xla": {"preemption_sync": True},
                                  "checkpoint": {"preemption_signals": ["SIGTERM"]}})
        out["xla2-sync"] = (dataclasses.replace(xla2, name="xla2-sync", spec=sync), 0)
    return out


PREEMPTED = preempted_cases()
# what spec() writes without changes: the job of the elastic and edge tests
DEFAULT = matrix.Case("default", "fsdp", {"backend": "fsdp", **TWO}, 2,
                      registry.get("fsdp").launch.env())


def job_of(case) -> str:
    """What decides the losses: the spec without how a preemption is agreed on."""
    spec = {k: v for k, v in case.spec.items() if k != "checkpoint"}
    if "xla" in spec:
        spec["xla"] = {k: v for k, v in spec["xla"].items() if k != "preemption_sync"}
    return json.dumps(spec, sort_keys=True)


def reference_groups(tmp):
    """(name, launch group, {job: spec}) of the jobs relaunched through `polyshard launch` (the
    default job and the sync manager's): their uninterrupted losses."""
    jobs = {job_of(c): c for c in [DEFAULT, *(c for n, (c, _) in PREEMPTED.items()
                                              if n.endswith("-sync"))]}
    out = []
    for group in matrix.by_launch(list(jobs.values())):
        specs = {job_of(c): json.loads(spec(tmp, f"ref-{c.name}", **c.spec).read_text())
                 for c in group}
        out.append((group[0].name, group, specs))
    return out


@pytest.fixture(scope="module")
def references(shared):
    """{job: the uninterrupted losses} of reference_groups, from the shared launches."""
    tmp, run = shared[__name__]
    out = {}
    for name, _, _ in reference_groups(tmp):
        out.update(read(tmp / f"references-{name}-out.json", run, "elastic_worker"))
    return out


@pytest.fixture(scope="module")
def uninterrupted(references):
    return references[job_of(DEFAULT)]


@pytest.mark.timeout(900)
def test_a_rank_killed_inside_a_save_restarts_from_the_checkpoint_before(tmp_path, uninterrupted):
    """SIGKILL of rank 1 inside save(step 6), after its own shards were written and before the
    checkpoint was complete: torchrun's agent restarts every worker (--max-restarts 2); the restart
    finds `latest` at step 4 and step 6 still a partial directory, resumes from step 4 (resume:
    auto) and steps 1-8 equal the uninterrupted run; steps 4, 6 (written again) and 8 verify."""
    spec_file, log, found = spec(tmp_path, "save"), tmp_path / "a.jsonl", tmp_path / "found.json"
    proc, seconds = launch(spec_file, log, "--kill-in-save", "6", "--found", found, restarts=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = [json.loads(x) for x in log.read_text().splitlines()]
    assert max(e["attempt"] for e in entries) == 1  # one restart happened
    seen = json.loads(found.read_text())
    assert seen["latest"] == "step-00000004" and seen["partial"] == [".step-00000006.partial"], seen
    assert next(e["step"] for e in entries if e["attempt"] == 1) == 5  # resumed from step 4
    assert losses(log) == uninterrupted
    root = tmp_path / "save"
    verify = subprocess.run([sys.executable, "-m", "parallel.cli", "ckpt", "verify", str(root)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stderr
    assert sorted(p.name for p in root.glob("step-*")) == [f"step-0000000{s}" for s in (4, 6, 8)]
    assert not list(root.glob(".*.partial"))  # the restart's save of step 6 replaced it
    record("faults-save", {"fault": "SIGKILL of rank 1 inside save(step 6), after its shards; "
                           "--max-restarts 2",
                           "restart found": f"latest {seen['latest']}, {seen['partial'][0]}",
                           "restart": "resume: auto from step 4, steps 1-8 equal uninterrupted",
                           "lost": "nothing", "launch seconds": round(seconds, 1)})


def preempted_groups(tmp):
    """(name, launch group, cases) of every preempted case but the sync manager's, each launch
    group in one launch (elastic_worker --preempt: reference, preempted run, resume, engine after
    engine)."""
    inline = [(n, c, who) for n, (c, who) in PREEMPTED.items() if not n.endswith("-sync")]
    out = []
    for group in matrix.by_launch([c for _, c, _ in inline]):
        names = {c.name for c in group}
        cases = {n: {"spec": json.loads(spec(tmp, f"preempt-{n}", **c.spec).read_text()),
                     "who": who} for n, c, who in inline if c.name in names}
        out.append((group[0].name, group, cases))
    return out


@needs_both
@pytest.mark.timeout(1200)
def test_sigterm_saves_exits_to_requeue_and_resumes_exactly(shared):
    """Every variant of the tier (matrix.py), one rank signalled (and every rank, on the first): SIGTERM
    after step 3, the ranks agree at the end of step 3 + 1 + (lag - 1), save a complete checkpoint
    there and raise Preempted (exit code 85); a fresh engine resumes from it (resume: auto) and
    steps 1-8 equal the same job's uninterrupted run bit for bit. One launch per launch group:
    engines one after another; a relaunch in fresh processes is test_sigterm_to_polyshard_launch's
    and the sync manager's below, and every variant's resume in fresh processes is its parity
    test's."""
    tmp, run = shared[__name__]
    rows = {}
    for name, _, _ in preempted_groups(tmp):
        rows.update(read(tmp / f"preempt-{name}-out.json", run, "elastic_worker"))
    assert set(rows) == {n for n in PREEMPTED if not n.endswith("-sync")}
    for name, row in rows.items():
        case, who = PREEMPTED[name]
        assert row["code"] == 85, (name, row)
        lag = 3 if case.backend == "xla_fsdp" else 2  # XLA reads the flag a step later (closure)
        assert row["latest"] == f"step-{3 + lag:08d}", (name, row)  # carried by step 4
        assert f"preempted after step {3 + lag}" in row["message"], (name, row)
        assert row["start"] == row["preempted"] == 3 + lag, (name, row)
        assert row["first"][:row["preempted"]] + row["resumed"] == row["reference"], (name, row)
        record(f"preemption-{name}", {
            "signal": f"SIGTERM to {'every rank' if who == -1 else f'rank {who}'} after step 3",
            "checkpoint": row["latest"], "exit code": row["code"], "resumed losses exact": True})


@needs_both
@pytest.mark.full  # make test-full: XLA v2's own, on TPU VM slices (45 s here)
@pytest.mark.timeout(900)
def test_the_sync_manager_agrees_saves_and_resumes_across_launches(tmp_path, references):
    """XLA v2 on TPU VM slices: torch_xla's preemption sync manager (the coordination service every
    host joins) picks the step; its own launch and a relaunch through `polyshard launch`."""
    if "xla2-sync" not in PREEMPTED:
        pytest.skip("no XLA v2 variant registered, or not make test-full (POLYSHARD_TIER=full)")
    case, who = PREEMPTED["xla2-sync"]
    spec_file, log = spec(tmp_path, "preempt", **case.spec), tmp_path / "preempt.jsonl"
    # the sync manager agrees over the coordination service in wall time (measured < 0.5 s), not
    # in steps: slow the steps down so the 5 left are enough (a real job has thousands left)
    first, seconds = launch(spec_file, log, "--signal-step", "3", "--kill-rank", str(who),
                            "--sleep", "0.5", env=case.env)
    assert first.returncode == 85, (first.returncode, first.stderr[-3000:])
    latest = (tmp_path / "preempt" / "latest").read_text().strip()
    assert int(latest[-8:]) > 3, latest  # the coordination service picks the step after the signal
    assert f"preempted after step {int(latest[-8:])}" in first.stderr, first.stderr[-2000:]
    second, _ = launch(spec_file, log, env=case.env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert losses(log) == references[job_of(case)]
    record("preemption-xla2-sync", {"signal": "SIGTERM to rank 0 after step 3", "checkpoint": latest,
                                    "exit code": first.returncode, "resumed losses exact": True,
                                    "first launch seconds": round(seconds, 1)})


@pytest.mark.timeout(900)
# make test: the save interrupted and signalled again; make test-full adds the signal before step 1
@pytest.mark.parametrize("when", [pytest.param("before-first-step", marks=pytest.mark.full),
                                  "during-save-and-again"])
def test_sigterm_at_the_edges(tmp_path, uninterrupted, when):
    """Before the first step: every rank exits 85 at the first train_step, no checkpoint is
    written, and the relaunch trains from scratch. During the save of step 2, then again after step
    3: that save completes (the handler only sets a flag), the ranks agree, save once, exit 85; the
    published checkpoints all verify and the relaunch resumes bit for bit."""
    from parallel.checkpoint.format.manifest import verify_checkpoint

    spec_file, log = spec(tmp_path, "edge"), tmp_path / "edge.jsonl"
    flags = ["--signal-step", "0"] if when == "before-first-step" else ["--signal-in-save", "2"]
    first, seconds = launch(spec_file, log, *flags, "--kill-rank", "1")
    assert first.returncode == 85, (first.returncode, first.stderr[-3000:])
    root = tmp_path / "edge"
    if when == "before-first-step":
        assert "before the first step" in first.stderr, first.stderr[-2000:]
        assert not log.is_file() and not (root / "latest").exists()
        written = "none"
    else:
        latest = (root / "latest").read_text().strip()
        assert f"preempted after step {int(latest[-8:])}" in first.stderr, first.stderr[-2000:]
        for step_dir in sorted(root.glob("step-*")):
            verify_checkpoint(step_dir)  # every published checkpoint is complete
        written = latest
    second, _ = launch(spec_file, log)
    assert second.returncode == 0, second.stderr[-3000:]
    assert losses(log) == uninterrupted
    record(f"preemption-{when}", {"signal": f"SIGTERM to rank 1 {when.replace('-', ' ')}",
                                  "checkpoint": written, "exit code": first.returncode,
                                  "resumed losses exact": True,
                                  "first launch seconds": round(seconds, 1)})


@pytest.mark.timeout(900)
def test_sigterm_to_polyshard_launch_reaches_the_workers(tmp_path, uninterrupted):
    """The scheduler signals the launcher, not the workers (Kubernetes: PID 1; Slurm with B:): the
    launcher and torchrun's agent pass it on, the workers save, the launch exits 85."""
    spec_file, log = spec(tmp_path, "notice"), tmp_path / "notice.jsonl"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "parallel.cli", "launch", str(spec_file),
                             str(DIST / "elastic_worker.py"), "--log", str(log), "--sleep", "1"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    while not (log.is_file() and len(log.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.perf_counter() - start < 300, proc.stderr.read()[-3000:]
        time.sleep(0.2)
    signalled = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 85, (proc.returncode, err[-3000:])
    latest = (tmp_path / "notice" / "latest").read_text().strip()
    second, _ = launch(spec_file, log)
    assert second.returncode == 0, second.stderr[-3000:]
    assert losses(log) == uninterrupted
    record("preemption-launcher", {"signal": "SIGTERM to `polyshard launch` after step 2",
                                   "checkpoint": latest, "exit code": proc.returncode,
                                   "seconds from signal to exit (1 s sleep per step)":
                                       round(time.perf_counter() - signalled, 1),
                                   "resumed losses exact": True})


@needs_both
@pytest.mark.timeout(300)
# the report is the engine's, the same on both (make test: FSDP2; make test-full: ZeRO-3 too)
@pytest.mark.parametrize("backend", ["fsdp", pytest.param("deepspeed", marks=pytest.mark.full)])
def test_stalled_rank_fails_the_launch_naming_it(tmp_path, backend):
    """Rank 1 sleeps before step 3; rank 0's first collective of the step (FSDP2's all-gather on
    its DeviceMesh group; ZeRO-3's) times out after timeout_s, and the report, gathered only now,
    names rank 1 and the line it is stuck on."""
    proc, seconds = launch(spec(tmp_path, "stall", timeout_s=5, backend=backend),
                           tmp_path / "s.jsonl", "--stall-step", "3", timeout=200)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "CollectiveTimeout: rank 0: step 3" in text, text[-3000:]
    assert "rank 1 last reported 'step 2: done'" in text and "time.sleep(120)" in text, text[-3000:]
    assert seconds < 90, seconds  # rank 1 sleeps 120 s: the launch did not wait for it
    report = next((tmp_path / "stall").glob("hang-report-rank0-*.txt")).read_text()
    assert "==== rank 1: step 2: done" in report and "time.sleep(120)" in report, report[-3000:]
    assert "==== rank 0: step 3" in report, report[-3000:]  # the failing rank's own stack too
    # torch's Flight Recorder: the collective rank 0 waits in, numbered, and rank 1's last on that
    # group, one behind (flight.py). On ZeRO-3 the error names none: no group's record shows a
    # collective enqueued and not completed there (make test-full, 2026-12-07; not investigated)
    place = re.search(r"in collective #(\d+) of group (\S+) \(", text)
    assert place or backend == "deepspeed", text[-3000:]
    behind = place and re.search(rf"its last collective on group {re.escape(place[2])}: #(\d+)",
                                 text)
    assert not place or (behind and int(behind[1]) < int(place[1])), text[-3000:]
    assert "collectives (torch's Flight Recorder, per group): {" in report, report[-3000:]
    assert "Every rank's Python stack:" in text, text[-3000:]
    record(f"faults-hang-{backend}", {
        "fault": "rank 1 stalls 120 s before step 3, timeout_s 5",
        "outcome": text[text.index("CollectiveTimeout: rank 0"):].splitlines()[0],
        "launch exit code": proc.returncode, "launch seconds": round(seconds, 1)})


@needs_both
@pytest.mark.timeout(300)
def test_a_collective_one_rank_entered_alone_is_named(tmp_path):
    """After step 2, rank 0's own code runs an all_reduce the other rank never enters (as a reload
    on one rank under ZeRO-3 did: issue #64). Outside the engine's guard, torch alone would fail it
    at timeout_s naming neither the call nor rank 1. The hang watch's sampler names both at half
    of timeout_s, while rank 0 still waits."""
    proc, seconds = launch(spec(tmp_path, "alone", timeout_s=6), tmp_path / "a.jsonl",
                           "--alone-step", "2", "--kill-rank", "0", timeout=200)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    line = next((x for x in text.splitlines() if "polyshard hang watch: rank 0" in x), None)
    assert line is not None, text[-3000:]
    assert "torch.distributed.all_reduce (called at elastic_worker.py:" in line, line
    assert "rank 1 at 'step 2: done'" in line and "time.sleep(20)" in line, line
    assert "1 of 2 ranks are in it" in line, line
    # torch's Flight Recorder numbers the all_reduce rank 0 entered; rank 1 stopped before it
    place = re.search(r"This rank is in collective #(\d+) of group (\S+) \(gloo:all_reduce", line)
    behind = place and re.search(rf"rank 1: its last collective on group {re.escape(place[2])}: "
                                 r"#(\d+)", line)
    assert behind and int(behind[1]) < int(place[1]), line
    assert seconds < 90, seconds
    record("faults-alone-collective", {
        "fault": "rank 0 runs all_reduce alone after step 2, timeout_s 6",
        "outcome": line[line.index("polyshard hang watch"):][:300],
        "launch seconds": round(seconds, 1)})


@pytest.mark.timeout(300)
def test_bad_batch_ends_the_launch_naming_the_rank(tmp_path):
    """No collective tells the healthy rank: torchrun's agent ends the job when rank 1 raises."""
    proc, seconds = launch(spec(tmp_path, "bad"), tmp_path / "b.jsonl", "--bad-batch-step", "3",
                           timeout=200)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "BatchError: step 3: rank 1: keys/dtypes differ" in text, text[-3000:]
    assert seconds < 60, seconds  # well inside timeout_s (60): nobody waited for a collective
    record("faults-bad-batch-launch", {"launcher": "polyshard launch (torchrun agent)",
                                       "fault": "rank 1's batch for step 3 has no labels",
                                       "outcome": "BatchError on rank 1; the agent ended rank 0",
                                       "launch seconds (timeout_s 60)": round(seconds, 1)})


@pytest.mark.timeout(300)
def test_bad_batch_under_one_task_per_device_ends_every_rank(tmp_path):
    """Slurm-style: each rank a process of its own (srun one task per device, no torchrun agent).
    rank 1 raises and exits; rank 0, inside the step's first collective, loses its peer and exits
    with a report naming the rank that sent none, long before timeout_s."""
    from parallel.dist import free_port

    spec_file = spec(tmp_path, "slurm")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK",
                                                                        "WORLD_SIZE", "TORCHELASTIC"))}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), SLURM_NTASKS="2",
                POLYSHARD_SPEC=str(spec_file), PYTHONPATH=str(ROOT), TORCH_CPP_LOG_LEVEL="ERROR")
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, str(DIST / "elastic_worker.py"), "--log",
                               str(tmp_path / "s.jsonl"), "--bad-batch-step", "3"],
                              env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs, ended = [], []
    for p in procs:
        outs.append(p.communicate(timeout=200)[0])
        ended.append(round(time.perf_counter() - start, 1))
    assert procs[1].returncode != 0 and "BatchError: step 3: rank 1:" in outs[1], outs[1][-2000:]
    assert procs[0].returncode != 0, outs[0][-2000:]
    assert "CollectiveTimeout: rank 0: step 3" in outs[0] and "rank 1" in outs[0], outs[0][-3000:]
    assert max(ended) < 60, ended  # timeout_s is 60: the peer's exit, not a timeout, ended rank 0
    record("faults-bad-batch-slurm", {
        "launcher": "one process per rank (srun-style: SLURM_PROCID, no agent)",
        "fault": "rank 1's batch for step 3 has no labels",
        "rank 0": outs[0][outs[0].index("CollectiveTimeout: rank 0"):].splitlines()[0][:300],
        "seconds until both exited (timeout_s 60)": max(ended)})
