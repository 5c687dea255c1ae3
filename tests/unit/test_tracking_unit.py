"""Tracking in one process: the section's rules, what an idle tracker keeps (nothing), MFU from its
formula, the progress bar in a log file, and close() closing the sinks. Every backend at 2 ranks
and each tracker's own reader: tests/distributed/test_tracking.py."""

import json

import pytest
import torch

from parallel.engine.observe.flops import model_flops, peak_flops
from parallel.engine.observe.tracking import Tracker, device_peak
from parallel.spec.io import SpecError, load_spec
from parallel.toy import ByteDataset, build_llama, llama_config


@pytest.mark.parametrize("tracking, field", [
    ({"to": ["jsonl", "jsonl"]}, "tracking.to"),
    ({"to": ["mlflow"], "mlflow_uri": "./mlruns"}, "tracking.mlflow_uri"),
    ({"to": ["mlflow"], "mlflow_uri": "file:///tmp/mlruns"}, "tracking.mlflow_uri"),
    ({"to": ["neptune"]}, "tracking.to"),
    ({"every": 0}, "tracking.every"),
    ({"run_name": "../escape"}, "tracking.run_name"),
])
def test_the_section_refuses_naming_the_field(tracking, field):
    with pytest.raises(SpecError) as err:
        load_spec({"tracking": tracking})
    assert field in str(err.value)


def test_an_idle_tracker_keeps_nothing_and_reads_nothing():
    spec = load_spec({})
    tracker = Tracker(spec, is_main=True, device=torch.device("cpu"))
    assert not tracker.active
    tracker.start(spec, (1, None), 1, {})
    tracker.after_step(object(), 8)  # not even looked at
    assert tracker.sinks == [] and tracker._window == []
    worker = Tracker(load_spec({"tracking": {"to": ["jsonl"]}}), is_main=False,
                     device=torch.device("cpu"))
    assert not worker.active  # only the main rank writes


def test_peak_flops_is_configured_or_known_never_guessed():
    assert device_peak(torch.device("cpu"), "bf16", None) is None
    assert device_peak(torch.device("cpu"), "fp32", 2.5) == 2.5e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12  # the specific name before the family
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12  # torch's default: no TF32
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32", tf32=True) == 156e12
    assert peak_flops("cpu", "bf16") is None


def test_mfu_progress_bar_and_close(tmp_path, capsys):
    from parallel import create_engine

    spec = load_spec({"backend": "fsdp", "micro_batch_size": 2, "tracking": {
        "to": ["jsonl"], "dir": str(tmp_path), "every": 2, "run_name": "one", "peak_tflops": 0.5}})
    engine = create_engine(spec)
    model = build_llama(llama_config("tiny"))
    params, (layers, hidden) = model_flops(model)
    engine.prepare(model, (torch.optim.SGD, {"lr": 0.1}))
    batches = iter(engine.dataloader(ByteDataset(seq_len=16)))
    with engine.progress_bar(total=4) as bar:
        for _ in range(4):
            bar.update(engine.train_step(next(batches)))
    engine.close()
    assert engine.tracker.sinks == []  # closed: the file is complete
    lines = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in lines if "train/mfu" in x]
    assert [x["step"] for x in train] == [2, 4]
    per_token = 6 * params + 12 * layers * hidden * 16  # PaLM's count, width 16
    for x in train:
        assert x["train/mfu"] == pytest.approx(x["train/tokens_per_s"] * per_token / 0.5e12)
    assert lines[0]["hparams"]["model.params"] == sum(p.numel() for p in model.parameters())
    assert params == lines[0]["hparams"]["model.params"] - model.model.embed_tokens.weight.numel()
    # not a terminal: one plain line per logged step, the tracker's numbers
    assert len(bar.lines) == 2 and f"loss {train[1]['train/loss']:.4f}" in bar.lines[1]
    assert "training step 4/4" in capsys.readouterr().err


def test_a_relaunched_job_continues_its_tracker_runs(tmp_path):
    """Two launches of one run (a preempted job resumed): MLflow logs into the same run, wandb
    resumes the same run id; a kept id that is not an id starts a new run instead of being used."""
    from types import SimpleNamespace

    from mlflow import MlflowClient

    from parallel.engine.observe.trackers import MlflowSink, WandbSink

    options = SimpleNamespace(mlflow_uri=None, wandb_mode="offline")
    run_dir = tmp_path / "job"
    run_dir.mkdir()
    for steps in ([1, 2], [3]):
        sinks = [MlflowSink(run_dir, "proj", "job", options), WandbSink(run_dir, "proj", "job", options)]
        for step in steps:
            for sink in sinks:
                sink.log({"train/loss": float(step)}, step)
        for sink in sinks:
            sink.close()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3]
    assert run.info.status == "FINISHED"
    kept = (run_dir / "wandb_run_id").read_text().strip()
    offline = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(kept) for name in offline), offline
    (run_dir / "mlflow_run_id").write_text("../../etc/passwd\n")
    sink = MlflowSink(run_dir, "proj", "job", options)
    assert sink.run_id != run.info.run_id
    sink.close()


def test_a_resuming_job_is_one_run_by_default():
    from parallel.engine.observe.tracking import default_run_name

    spec = load_spec({"checkpoint": {"dir": "/tmp/ckpt/llama-sft", "resume": "auto"}})
    assert default_run_name(spec) == f"{spec.backend}-{spec.shard}-llama-sft"
    assert default_run_name(load_spec({})).startswith(f"{spec.backend}-{spec.shard}-20")  # a time
