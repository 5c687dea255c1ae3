"""Real faults, injected: non-finite losses and malformed batches on every backend, a SIGKILLed worker
under `polyshard launch --max-restarts 2`, a rank SIGKILLed in the middle of a save, a stalled rank.
Each outcome is recorded for docs/reliability.md."""

import json
import subprocess
import sys
import time

import pytest
from harness import ROOT, torchrun, needs_both
from reliability import record

pytestmark = pytest.mark.distributed

DIST = ROOT / "tests" / "distributed"
TWO = {"topology": {"procs_per_node": 2}, "micro_batch_size": 2}
TORCH = {"fsdp2": {"backend": "fsdp", **TWO},
         "zero0": {"backend": "deepspeed", "shard": "none", **TWO},
         "zero2": {"backend": "deepspeed", "shard": "grad_op", **TWO},
         "zero3": {"backend": "deepspeed", "shard": "full", **TWO}}
XLA = {"xla1": ({"backend": "xla_fsdp", "micro_batch_size": 4, "xla": {"fsdp_version": 1}}, 1),
       "xla2": ({"backend": "xla_fsdp", "micro_batch_size": 2, "xla": {"fsdp_version": 2}}, 2)}


def fault_run(tmp, name, cases, nproc=2, env=None):
    (tmp / f"{name}.json").write_text(json.dumps(cases))
    torchrun(nproc, [str(DIST / "fault_worker.py"), "--cases", str(tmp / f"{name}.json"),
                     "--out", str(tmp / f"{name}-out.json")], timeout=400, env=env)
    return json.loads((tmp / f"{name}-out.json").read_text())


@needs_both
@pytest.mark.timeout(900)
def test_nonfinite_loss_and_bad_batches_on_every_backend(tmp_path):
    results = fault_run(tmp_path, "torch", TORCH)
    for name, (spec, devices) in XLA.items():
        env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "USE_TORCH_XLA": "1"}
        results.update(fault_run(tmp_path, name, {name: spec}, nproc=1, env=env))
    rows = []
    for backend in [*TORCH, *XLA]:
        nonfinite = results[f"{backend}/nonfinite"]
        assert "error" not in nonfinite, nonfinite["error"]
        skipped = nonfinite["skip_losses"][3:]
        assert skipped == nonfinite["clean_losses"][2:], (backend, nonfinite)  # nothing moved
        assert nonfinite["skip_stepped"] == [True, True, False, True, True]
        assert nonfinite["raise"].startswith("NonFiniteLossError: step 3: non-finite loss on rank")
        rows += [{"fault": "NaN loss, on_nonfinite: skip", "backend": backend,
                  "outcome": "step skipped; steps 4-5 equal a run without it"},
                 {"fault": "NaN loss, on_nonfinite: raise", "backend": backend,
                  "outcome": nonfinite["raise"][:80] + "..."}]
        bad = results[f"{backend}/badbatch"]
        for fault, needle in (("missing_labels", "missing ['labels']"), ("empty", "empty batch"),
                              ("float_ids", "torch.float32")):
            assert bad[fault].startswith("BatchError: step 2: rank") and needle in bad[fault], bad
            rows.append({"fault": f"bad batch: {fault}", "backend": backend,
                         "outcome": "BatchError on every rank before any collective"})
    record("faults-step", {"summary": f"{len(rows)} faults injected, {len(rows)} handled as stated",
                           "rows": rows})


def launch(spec_file, log, *extra, timeout=240):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "parallel.cli", "launch", "--max-restarts",
                           "2" if "--kill-step" in extra else "0", str(spec_file),
                           str(DIST / "elastic_worker.py"), "--log", str(log), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - start


def losses(log):
    last = {}
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        last[entry["step"]] = entry["loss"]  # a restarted step's loss replaces the first attempt's
    return [last[s] for s in sorted(last)]


def spec(tmp, name, timeout_s=60):
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps({"backend": "fsdp", **TWO, "timeout_s": timeout_s, "checkpoint": {
        "dir": str(tmp / name), "every": 2, "resume": "auto", "keep_last": 3}}))
    return path


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    proc, _ = launch(spec(tmp, "clean"), tmp / "clean.jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(tmp / "clean.jsonl")


@pytest.mark.timeout(900)
def test_sigkilled_worker_restarts_and_resumes_with_the_same_losses(tmp_path, uninterrupted):
    proc, seconds = launch(spec(tmp_path, "elastic"), tmp_path / "kill.jsonl", "--kill-step", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    attempts = [json.loads(x)["attempt"] for x in (tmp_path / "kill.jsonl").read_text().splitlines()]
    assert max(attempts) == 1  # one restart happened
    assert losses(tmp_path / "kill.jsonl") == uninterrupted
    record("faults-elastic", {"fault": "SIGKILL of rank 1 after step 5, --max-restarts 2",
                              "restarts": max(attempts), "resumed_from": "step-00000004",
                              "steps 1-8 equal an uninterrupted run": True,
                              "launch seconds": round(seconds, 1)})


@pytest.mark.timeout(900)
def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, uninterrupted):
    spec_file = spec(tmp_path, "save")
    proc, _ = launch(spec_file, tmp_path / "a.jsonl", "--kill-in-save", "6")
    assert proc.returncode != 0
    root = tmp_path / "save"
    assert (root / "latest").read_text().strip() == "step-00000004"
    assert (root / ".step-00000006.partial").is_dir() and not (root / "step-00000006").exists()
    verify = subprocess.run([sys.executable, "-m", "parallel.cli", "ckpt", "verify", str(root)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stderr
    proc, _ = launch(spec_file, tmp_path / "b.jsonl")  # resume: auto picks up step 4
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = [json.loads(x) for x in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert resumed[0]["step"] == 5 and losses(tmp_path / "b.jsonl") == uninterrupted[4:]
    assert sorted(p.name for p in root.glob("step-*")) == [f"step-0000000{s}" for s in (4, 6, 8)]
    record("faults-save", {"fault": "SIGKILL of rank 1 inside save(step 6), after its shards",
                           "latest after the crash": "step-00000004 (verified)",
                           "next launch": "resume: auto from step 4, steps 5-8 equal uninterrupted",
                           "lost": "nothing"})


@pytest.mark.timeout(300)
def test_stalled_rank_fails_the_launch_naming_it(tmp_path):
    proc, seconds = launch(spec(tmp_path, "stall", timeout_s=5), tmp_path / "s.jsonl",
                           "--stall-step", "3", timeout=200)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "CollectiveTimeout: rank 0: step 3" in text and "rank 1 last reported" in text
    assert seconds < 90, seconds  # rank 1 sleeps 120 s: the launch did not wait for it
    record("faults-hang", {"fault": "rank 1 stalls 120 s before step 3, timeout_s 5",
                           "outcome": text[text.index("CollectiveTimeout: rank 0"):].splitlines()[0],
                           "launch exit code": proc.returncode,
                           "launch seconds": round(seconds, 1)})
