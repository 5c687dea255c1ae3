"""`polyshard explain` output is a DeepSpeed config that `deepspeed.initialize` accepts and trains with,
once its model-sized buckets are filled from the model as prepare fills them."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed
BUDGET_S = 30  # seconds in make test (tests/conftest.py)

INIT = """
import json, sys, torch, deepspeed
from parallel.toy import build_llama, llama_config
from backends.deepspeed.config.translate import fill_model_autos
model = build_llama(llama_config("tiny"))
config = fill_model_autos(json.loads(sys.stdin.read())["config"], model)
engine, opt, _, _ = deepspeed.initialize(model=model, config=config,
    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), model_parameters=model.parameters())
ids = torch.randint(0, 256, (2, 8))
loss = engine(input_ids=ids, labels=ids).loss
engine.backward(loss); engine.step()
print("initialized", engine.zero_optimization_stage(), engine.gradient_clipping())
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shard", [pytest.param("optimizer", marks=pytest.mark.full), "full"])
def test_explain_output_is_a_config_deepspeed_initialize_accepts(tmp_path, shard):
    pytest.importorskip("deepspeed")
    spec = tmp_path / "s.yaml"
    spec.write_text(f"backend: deepspeed\nshard: {shard}\nmicro_batch_size: 2\n")
    explained = subprocess.run([sys.executable, "-m", "parallel.cli", "explain", str(spec)],
                               capture_output=True, text=True, timeout=120, check=True).stdout
    env_run = subprocess.run(
        [sys.executable, "-c", INIT], input=explained, capture_output=True, text=True, timeout=150,
        env={**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + len(shard))})
    assert env_run.returncode == 0, env_run.stderr[-3000:]
    stage = {"optimizer": 1, "full": 3}[shard]
    assert f"initialized {stage} 0.0" in env_run.stdout
