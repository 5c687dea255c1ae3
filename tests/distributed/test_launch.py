"""`polyshard launch` end to end: the demo script under each backend, through the launcher's own
environment handling (USE_TORCH_XLA, PJRT_DEVICE) and the engine's data loader (MpDeviceLoader on XLA)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
BUDGET_S = 105  # seconds in make test (tests/conftest.py)
ROOT = Path(__file__).resolve().parents[2]
POLYSHARD = [sys.executable, "-m", "parallel.cli"]


def launch(tmp_path, sets, env=None, steps=3, flags=()):
    """The installed `polyshard` command run from a working directory holding a `parallel/`
    package of its own: polyshard's children (the launch agent, the async writer) start with -P,
    so it runs in none of them (it ran in both: #65)."""
    planted = tmp_path / "cwd" / "parallel"
    planted.mkdir(parents=True)
    marker = tmp_path / "planted-ran"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('ran\\n')\n")
    cmd = [str(Path(sys.executable).parent / "polyshard"), "launch", *flags,
           *[x for s in sets for x in ("--set", s)], str(ROOT / "configs/demo.yaml"),
           str(ROOT / "examples/train_lm.py"), "--model-size", "tiny", "--stop-at", str(steps),
           "--save", str(tmp_path / "ckpt")]
    clean = {k: v for k, v in os.environ.items() if k not in ("USE_TORCH_XLA", "PJRT_DEVICE")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=planted.parent,
                         env={**clean, "PYTHONPATH": str(ROOT), **(env or {})})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-5000:]
    assert "saved step 3" in text and "Defaulting to PJRT_DEVICE" not in text, text[-3000:]
    assert not marker.exists(), "the working directory's parallel/ ran in a child"
    return text


@pytest.mark.timeout(300)
def test_launch_fsdp_two_ranks_quietly_and_tracked(tmp_path):
    text = launch(tmp_path, [f"tracking.dir={tmp_path / 'track'}", "tracking.every=1",
                             "checkpoint.async_save=true"])  # its writer process too
    assert "fsdp (full, fp32) on 2 rank(s)" in text
    assert "[Gloo]" not in text, text[-3000:]  # hidden by default (parallel/launch/quiet.py)
    # the demo spec's trackers: one run, steps 1-3, from the main rank only
    lines = (tmp_path / "track" / "demo" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x).get("step") for x in lines] == [None, 1, 2, 3]
    assert list((tmp_path / "track" / "demo" / "tensorboard").glob("events.out.tfevents.*"))
    # a log file gets plain progress lines, not a live bar's redraws
    assert "training step 3/3 loss " in text and "\r" not in text


@pytest.mark.timeout(300)
@pytest.mark.full  # make test-full: make test's launches are the quiet ones (test above)
def test_launch_verbose_shows_what_quiet_hides(tmp_path):
    """torch 2.15's gloo prints no connection lines (torch 2.9's did, 3 per rank: quiet.py), so the
    ranks print the noise themselves: gloo's line and torchrun's banner, which --verbose passes on
    and a quiet launch drops, while the rank's own line stays in both."""
    script = tmp_path / "noisy.py"
    script.write_text("import os, sys\nr = os.environ['RANK']\n"
                      "print(f'[Gloo] Rank {r} is connected to 1 peer ranks. Expected number of "
                      "connected peer ranks is : 1', file=sys.stderr)\n"
                      "print('*' * 40, file=sys.stderr)\nprint(f'rank {r} trained', flush=True)\n")
    texts = {}
    for flags in ((), ("--verbose",)):
        cmd = [str(Path(sys.executable).parent / "polyshard"), "launch", *flags,
               str(ROOT / "configs/demo.yaml"), str(script)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, out.stderr[-3000:]
        texts[flags] = out.stdout + out.stderr
    quiet, verbose = texts[()], texts[("--verbose",)]
    assert "rank 0 trained" in quiet and "rank 1 trained" in verbose
    assert "[Gloo] Rank" not in quiet and "*" * 40 not in quiet, quiet[-3000:]
    assert verbose.count("[Gloo] Rank") == 2 and "*" * 40 in verbose, verbose[-3000:]


@pytest.mark.timeout(300)
# the schedule reaches the optimizer DeepSpeed steps whatever the stage: one stage in make test, the
# others in make test-full
@pytest.mark.parametrize("shard", [pytest.param("none", marks=pytest.mark.full), "grad_op",
                                   pytest.param("full", marks=pytest.mark.full)])
def test_launch_deepspeed_with_lr_schedule(tmp_path, shard):
    pytest.importorskip("deepspeed")
    text = launch(tmp_path, ["backend=deepspeed", f"shard={shard}"])
    assert f"deepspeed ({shard}, fp32) on 2 rank(s)" in text
    # the warm-up schedule reached the optimizer DeepSpeed steps: lr after step 1 and step 3
    assert "lr 6.0e-04 -> 1.8e-03" in text, text[-2000:]


@pytest.mark.full  # make test launches the same layout: test_xla_is_one_field_away_on_a_cpu_host
@pytest.mark.timeout(300)
def test_launch_xla_spmd_with_device_loader(tmp_path):
    pytest.importorskip("torch_xla")
    text = launch(tmp_path, ["backend=xla_fsdp", "xla.fsdp_version=2", "topology.procs_per_node=1",
                             "micro_batch_size=4"], env={"CPU_NUM_DEVICES": "2"})
    assert "xla_fsdp (full, fp32) on 1 rank(s)" in text


@pytest.mark.timeout(300)
def test_xla_is_one_field_away_on_a_cpu_host(tmp_path):
    """`backend: xla_fsdp` on the demo spec (2 processes): the launcher runs the CPU client's layout
    (one process over 2 virtual devices, SPMD FSDPv2) and says so in one line."""
    pytest.importorskip("torch_xla")
    text = launch(tmp_path, ["backend=xla_fsdp", f"tracking.dir={tmp_path / 'track'}"])
    assert ("polyshard: xla_fsdp on this host runs as topology.procs_per_node 2 -> 1, "
            "xla.fsdp_version 1 -> 2, CPU_NUM_DEVICES=2") in text, text[-3000:]
    assert "GSPMD sharding propagation is going to be deprecated" not in text


FAILING = """
import torch
from torch import nn
from parallel import create_engine
from parallel.launch.torchrun import current_spec
engine = create_engine(current_spec())
engine.prepare(nn.Sequential(nn.Linear(4, 4)), (torch.optim.SGD, {"lr": 0.1}))  # no _no_split_modules
"""


@pytest.mark.timeout(200)
def test_a_failing_job_reports_the_first_error_once(tmp_path):
    """Every rank raises the same SpecError: one line per rank, then the first failure once, with
    its exit code; no traceback and no torchrun ChildFailedError block."""
    (tmp_path / "fail.py").write_text(FAILING)
    out = subprocess.run([*POLYSHARD, "launch", "--nproc", "2", "configs/demo.yaml",
                          str(tmp_path / "fail.py")], capture_output=True, text=True, timeout=180,
                         cwd=ROOT)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    summary = text[text.index("polyshard launch: the job failed; rank"):]
    assert "SpecError: wrap.policy: 'auto' reads `_no_split_modules`" in summary, text[-3000:]
    assert "traceback: " in summary and "error.json" in summary
    assert "Traceback (most recent call last)" not in text and "ChildFailedError" not in text, text


LISTENING = """
import json, os, sys
import psutil
from parallel import create_engine
from parallel.launch import current_spec
engine = create_engine(current_spec())
agent = psutil.Process(os.getppid())  # torchrun's agent, which serves the rendezvous stores
mine = [c.laddr.ip for p in (agent, psutil.Process()) for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN]
json.dump(mine, open(sys.argv[1] + f".{engine.rank}", "w"))
engine.close()
"""


@pytest.mark.timeout(200)
def test_one_host_listens_on_loopback_only(tmp_path):
    """The stores torchrun's agent serves listen on every interface by default (unauthenticated, hang
    reports travel through them); on one host polyshard binds them to 127.0.0.1 (docs/security.md)."""
    (tmp_path / "listen.py").write_text(LISTENING)
    out = subprocess.run([*POLYSHARD, "launch", "--nproc", "2", "configs/demo.yaml",
                          str(tmp_path / "listen.py"), str(tmp_path / "addr")],
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    import json

    seen = [ip for rank in (0, 1) for ip in json.loads((tmp_path / f"addr.{rank}").read_text())]
    assert seen and set(seen) == {"127.0.0.1"}, seen



def test_a_launch_whose_rank_aborted_runs_once_more_and_is_recorded(tmp_path, monkeypatch):
    """harness.torchrun: a rank dying with libstdc++'s abort runs the launch once more and records
    it (the run's summary lists it: tests/conftest.py); a second abort fails."""
    import harness
    import reliability

    monkeypatch.setattr(reliability, "STORE", tmp_path / "store")
    script = tmp_path / "aborts_once.py"
    script.write_text(
        "import os, sys\n"
        f"marker = {str(tmp_path / 'ran')!r}\n"
        "first = not os.path.exists(marker)\n"
        "open(marker, 'a').write('x')\n"
        f"if first or os.path.exists({str(tmp_path / 'always')!r}):\n"
        f"    print({harness.ABORT!r}, file=sys.stderr, flush=True)\n"
        "    os.abort()\n")
    harness.torchrun(1, [str(script)], timeout=60)
    (record,) = reliability.records(reliability.RELAUNCHED, tmp_path / "store")
    assert record["ranks"] == 1 and "aborts_once.py" in record["command"], record
    (tmp_path / "always").write_text("")
    with pytest.raises(AssertionError, match="exit -6"):
        harness.torchrun(1, [str(script)], timeout=60)
