"""DeepSpeed imported by a job without mlflow (backends/deepspeed/library.py): its autotuner, which
polyshard never runs, imported mlflow in every rank of every DeepSpeed job (2-3 s of a 6.5-8 s import
here). mlflow itself still imports afterwards, for a tracker."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

JOB = """
import sys
from parallel import create_engine, load_spec
create_engine(load_spec({"backend": "deepspeed", "shard": "full"}))  # the job's first DeepSpeed import
from deepspeed.autotuning import autotuner
print("mlflow imported:", "mlflow" in sys.modules, "autotuner has_mlflow:", autotuner.has_mlflow)
import mlflow  # a tracker's import, after the engine: as before
print("mlflow", mlflow.__version__)
"""


def test_a_deepspeed_engine_does_not_import_mlflow_and_mlflow_still_imports():
    out = subprocess.run([sys.executable, "-c", JOB], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mlflow imported: False autotuner has_mlflow: False" in out.stdout, out.stdout
    assert "mlflow 3." in out.stdout, out.stdout
