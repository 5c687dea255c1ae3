"""DeepSpeed imported by a job without what only features polyshard never runs import
(backends/deepspeed/runtime/library.py): mlflow (its autotuner's, 2-3 s of a 6.5-8 s import here) and
torch's inductor (its ZeRO check imports its Muon optimizer, whose decorators compile: 5.1 s). mlflow
still imports afterwards, for a tracker, and Muon's functions compile at their first call."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

JOB = """
import sys
import torch
from parallel import create_engine, load_spec
from parallel.toy import build_llama, llama_config
engine = create_engine(load_spec({"backend": "deepspeed", "shard": "full"}))  # its first import
engine.prepare(build_llama(llama_config("tiny")), (torch.optim.AdamW, {"lr": 1e-3}))  # ZeRO's check
from deepspeed.autotuning import autotuner
from deepspeed.runtime.zero.muon import original_muon
print("mlflow imported:", "mlflow" in sys.modules, "autotuner has_mlflow:", autotuner.has_mlflow)
print("inductor compile_fx imported:", "torch._inductor.compile_fx" in sys.modules)
print("muon compiles later:", hasattr(original_muon.zeropower_via_newtonschulz5, "__wrapped__"),
      "torch.compile restored:", torch.compile.__module__ == "torch")
import mlflow  # a tracker's import, after the engine: as before
print("mlflow", mlflow.__version__)
"""


def test_a_deepspeed_engine_imports_neither_mlflow_nor_inductor_and_both_still_work():
    out = subprocess.run([sys.executable, "-c", JOB], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for line in ("mlflow imported: False autotuner has_mlflow: False", "inductor compile_fx imported: False",
                 "muon compiles later: True torch.compile restored: True", "mlflow 3."):
        assert line in out.stdout, out.stdout
