"""Experiment tracking on every case of the registry at 2 ranks (XLA: its CPU layout): what each
tracker holds is read back with that tracker's own reader and compared with the StepResults the
ranks saw. The first case writes to all four trackers; the others to jsonl (the sinks are the same
code on every backend; the metrics come from the engine's step)."""

import json
import struct

import matrix
import pytest
from harness import needs_both
from shared import job, read

pytestmark = pytest.mark.distributed
BUDGET_S = 30  # seconds in make test (tests/conftest.py)

CASES = matrix.cases(world=2, micro_batch_size=2)
ALL = ["jsonl", "tensorboard", "mlflow", "wandb"]


def to(name: str) -> list[str]:
    return ALL if name == CASES[0].name else ["jsonl"]


def shared_jobs(tmp):
    """One job per launch group in the suite's shared launches (shared.py)."""
    jobs = []
    for i, group in enumerate(matrix.by_launch(CASES)):
        (tmp / f"tracking{i}").mkdir()
        (tmp / f"tracking{i}" / "cases.json").write_text(json.dumps(
            [{"name": c.name, "spec": c.spec, "to": to(c.name)} for c in group]))
        jobs.append(job("tracking_worker", ["--cases", tmp / f"tracking{i}" / "cases.json",
                                            "--out", tmp / f"tracking{i}"],
                        group[0].nproc, group[0].env))
    return jobs


@pytest.fixture(scope="module")
def runs(shared):
    root, run = shared[__name__]
    out = {}
    for i, group in enumerate(matrix.by_launch(CASES)):
        tmp = root / f"tracking{i}"
        for rank in range(group[0].nproc):
            for name, record in read(tmp / f"records.rank{rank}.json", run,
                                     "tracking_worker").items():
                out.setdefault(name, {"dir": tmp / name, "ranks": []})["ranks"].append(record)
    return out


def jsonl(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return lines[0]["hparams"], {x["step"]: x for x in lines[1:] if "train/loss" in x}, lines


@needs_both
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_logged_metrics_are_the_steps(runs, name):
    run = runs[name]
    for r in run["ranks"]:
        assert "error" not in r, r.get("error")
    seen = run["ranks"][0]["steps"]
    hparams, train, lines = jsonl(run["dir"])
    assert hparams["backend"] == CASES[[c.name for c in CASES].index(name)].backend
    assert hparams["tracking.every"] == 2 and hparams["model.params"] > 0
    assert sorted(train) == [2, 4]  # every 2 steps, once: the other rank wrote nothing
    for step, logged in train.items():
        step_seen = seen[str(step)]
        assert logged["train/loss"] == step_seen["loss"]
        assert logged["train/grad_norm"] == pytest.approx(step_seen["grad_norm"], rel=1e-6)
        assert logged["train/lr"] == step_seen["lr"]
        # target tokens: labels != -100 after the shift, all ranks (31 per row of 32)
        ratio = logged["train/target_tokens_per_s"] / logged["train/tokens_per_s"]
        assert ratio == pytest.approx(31 / 32, rel=1e-9)
        assert 0 < logged["train/mfu"] < 1 and logged["memory/host_rss_gib"] > 0.1
    assert [x for x in lines if "user/answer" in x] == [{"step": 4, "user/answer": 42.0}]
    evals = [x for x in lines if "eval/loss" in x]
    assert len(evals) == 1 and evals[0]["eval/loss"] == pytest.approx(run["ranks"][0]["eval_loss"])
    bar = run["ranks"][0]["bar"]  # a pipe, not a terminal: a plain line every 2 steps
    assert len(bar) == 2 and bar[1].startswith("training step 4/4 loss ")
    assert run["ranks"][-1]["bar"] == [] or len(run["ranks"]) == 1  # main rank only


def wandb_records(path):
    """wandb's transaction log (LevelDB log framing, wandb-core's writer) parsed with wandb's own
    protobuf schema: wandb 0.31 ships no Python reader."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last fragment of one
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


@needs_both
@pytest.mark.timeout(900)
def test_each_tracker_read_back_with_its_own_reader(runs):
    name = CASES[0].name
    run_dir = runs[name]["dir"]
    _, train, _ = jsonl(run_dir)
    want = {s: x["train/loss"] for s, x in train.items()}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    got = {e.step: e.value for e in events.Scalars("train/loss")}
    assert got == pytest.approx(want, rel=1e-6)  # TensorBoard stores float32
    assert "eval/loss" in events.Tags()["scalars"]

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir.parent / 'mlflow.db'}")
    [found] = client.search_runs([client.get_experiment_by_name("polyshard").experiment_id])
    assert found.info.run_name == name and found.info.status == "FINISHED"
    history = {m.step: m.value for m in client.get_metric_history(found.info.run_id,
                                                                  "train/loss")}
    assert history == want
    assert found.data.params["backend"] == CASES[0].backend

    [log] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            if "train/loss" in items:
                history[items["_step"]] = items["train/loss"]
        elif kind == "config":
            config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                           for i in record.config.update})
    assert history == want
    assert config.get("backend") == CASES[0].backend
