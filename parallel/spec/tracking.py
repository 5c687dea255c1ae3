"""The `tracking:` section: where a run's metrics go, through each tracker's own library.

Only the main rank writes. What is logged and what it costs: parallel/engine/observe/tracking.py and
docs/tracking.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from parallel.spec.sections import Section, rule_error

Tracker = Literal["tensorboard", "mlflow", "wandb", "jsonl"]


class Tracking(Section):
    to: Annotated[
        list[Tracker],
        Field(description="Trackers that receive the run's metrics, each through its own library: "
              "tensorboard (torch's SummaryWriter), mlflow (MlflowClient; a local SQLite store by "
              "default), wandb (offline by default), jsonl (one JSON object per line, no "
              "dependency). Empty (default): nothing is logged and the step pays nothing."),
    ] = []
    dir: Annotated[
        str,
        Field(description="Where local trackers write: <dir>/<run_name>/ holds the TensorBoard "
              "events, metrics.jsonl and wandb's offline run; the MLflow store is <dir>/mlflow.db."),
    ] = "runs/tracking"
    project: Annotated[
        str,
        Field(min_length=1, description="The wandb project and the MLflow experiment name."),
    ] = "polyshard"
    run_name: Annotated[
        str | None,
        Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="The run's name in every tracker "
              "and its folder under `dir`; a launch that finds its folder continues the run there (MLflow "
              "and wandb run ids are kept in it). Default: <backend>-<shard>-<start time>, decided "
              "by the main rank; with checkpoint.resume: auto <backend>-<shard>-<the checkpoint "
              "directory's name>, so a resumed job stays one run."),
    ] = None
    every: Annotated[
        int,
        Field(ge=1, description="Log training metrics every N optimizer steps. The step's loss is "
              "read to the host on those steps only (the main rank waits for the device there, as "
              "a hand-written loop's logging does); rates are averaged over the N steps."),
    ] = 10
    mlflow_uri: Annotated[
        str | None,
        Field(description="MLflow tracking URI: a server (http[s]://) or a database "
              "(sqlite:///path). Default: sqlite:///<dir>/mlflow.db. MLflow 3 refuses its file "
              "store unless MLFLOW_ALLOW_FILE_STORE=true, so file: URIs and bare paths are refused "
              "here rather than at the first log."),
    ] = None
    wandb_mode: Annotated[
        Literal["offline", "online"],
        Field(description="wandb's mode. offline (default): the run is written under `dir` and "
              "uploaded later with `wandb sync`; online needs a login and network."),
    ] = "offline"
    peak_tflops: Annotated[
        float | None,
        Field(gt=0, description="The device's peak TFLOP/s for the compute dtype, used for MFU. "
              "Default: known for common GPUs in bf16/fp16 (H100, H200, A100, ...); otherwise MFU "
              "is not logged (never guessed, e.g. on CPU)."),
    ] = None

    @model_validator(mode="after")
    def _rules(self) -> Tracking:
        problems = []
        if len(set(self.to)) != len(self.to):
            problems.append(("tracking.to", f"{self.to} names a tracker twice; list each once"))
        uri = self.mlflow_uri
        if uri is not None and (uri.startswith("file:") or "://" not in uri):
            problems.append(("tracking.mlflow_uri", f"{uri!r} is MLflow's file store, which MLflow "
                             "3 refuses unless MLFLOW_ALLOW_FILE_STORE=true; use sqlite:///PATH/"
                             "mlflow.db (or leave it unset for <dir>/mlflow.db) or a server URL"))
        if problems:
            raise rule_error(*problems)
        return self
