"""One sink per tracker, each through its library's own API (imported only when listed in
`tracking.to`). A sink takes flat {name: number} metrics at a step, the run's hyper-parameters once,
and is closed once. Nothing here keeps module state: the libraries' own globals (wandb.run) are
theirs."""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

from parallel.files import open_append, write_atomic


def kept_id(run_dir: Path, name: str, pattern: str) -> str | None:
    """The run id a previous launch of this run kept in its folder (read as bounded data: a
    small file matching the tracker's id format), or None: then a new run starts."""
    path = run_dir / name
    if not path.is_file() or path.is_symlink() or path.stat().st_size > 256:
        return None
    text = path.read_text(encoding="ascii", errors="replace").strip()
    return text if re.fullmatch(pattern, text) else None


def keep_id(run_dir: Path, name: str, run_id: str) -> None:
    write_atomic(run_dir / name, (run_id + "\n").encode("ascii"))  # no-follow, whole or nothing


class JsonlSink:
    """metrics.jsonl: one object per line ({"step": N, ...} or {"hparams": {...}}), flushed per
    line so a killed run keeps what it logged. No dependency."""

    def __init__(self, run_dir: Path, project: str, run_name: str, options):
        self.file = open_append(run_dir / "metrics.jsonl", "the run's metrics")  # no link followed

    def hparams(self, params: dict) -> None:
        self._write({"hparams": params})

    def log(self, metrics: dict, step: int) -> None:
        self._write({"step": step, **metrics})

    def _write(self, obj: dict) -> None:
        self.file.write(json.dumps(obj, sort_keys=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """torch.utils.tensorboard's SummaryWriter: scalars per metric, the hyper-parameters in the
    HPARAMS tab (written into the run's own event file, not the sub-run add_hparams makes)."""

    def __init__(self, run_dir: Path, project: str, run_name: str, options):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def hparams(self, params: dict) -> None:
        from torch.utils.tensorboard.summary import hparams

        plain = {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
                 for k, v in params.items()}
        for summary in hparams(plain, {}):
            self.writer.file_writer.add_summary(summary)

    def log(self, metrics: dict, step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class MlflowSink:
    """MlflowClient (no fluent API: no active-run global), one run in experiment `project`; a
    local SQLite store by default (MLflow 3 refuses its file store, docs/tracking.md)."""

    def __init__(self, run_dir: Path, project: str, run_name: str, options):
        from mlflow import MlflowClient

        uri = options.mlflow_uri or f"sqlite:///{(run_dir.parent / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(project)
        experiment = found.experiment_id if found else self.client.create_experiment(project)
        self.run_id = self._continued(run_dir, experiment)
        if self.run_id is None:  # a new run, its id kept for the launches that resume this job
            self.run_id = self.client.create_run(experiment, run_name=run_name).info.run_id
            keep_id(run_dir, "mlflow_run_id", self.run_id)

    def _continued(self, run_dir: Path, experiment: str) -> str | None:
        """The run a previous launch of this job started, marked running again; None when there
        is none (or it is not in this store and experiment)."""
        from mlflow.exceptions import MlflowException

        run_id = kept_id(run_dir, "mlflow_run_id", r"[0-9a-f]{32}")
        if run_id is None:
            return None
        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return None
        if run.info.experiment_id != experiment:
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run_id

    def hparams(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]  # MLflow's value limit
        for i in range(0, len(items), 100):  # log_batch takes at most 100 params a call
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, metrics: dict, step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step)
                                                    for k, v in metrics.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbSink:
    """wandb.init with the run's own settings (offline by default, console capture off so our
    logs stay ours)."""

    def __init__(self, run_dir: Path, project: str, run_name: str, options):
        import wandb

        run_id = kept_id(run_dir, "wandb_run_id", r"[a-z0-9]{8,64}")
        if run_id is None:  # a new run, its id kept for the launches that resume this job
            run_id = secrets.token_hex(8)  # wandb ids: [a-z0-9], 8 by its own generator
            keep_id(run_dir, "wandb_run_id", run_id)
        self.run = wandb.init(project=project, name=run_name, dir=str(run_dir), id=run_id,
                              resume="allow", mode=options.wandb_mode,
                              settings=wandb.Settings(console="off", silent=True))

    def hparams(self, params: dict) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


SINKS = {"jsonl": JsonlSink, "tensorboard": TensorBoardSink, "mlflow": MlflowSink,
         "wandb": WandbSink}
