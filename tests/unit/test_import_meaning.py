"""Four imports that changed a real file's meaning (issue #25), each checked with the tool's own parser
as the oracle: DeepSpeed's DeepSpeedConfig, accelerate's launcher and FSDP plugin."""

import ast
import functools
import os
import re
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml

from backends.deepspeed.files import interop as ds_interop
from accelerate_host import gpu_host
from parallel.interop.accelerate import from_accelerate
from parallel.spec.io import SpecError, load_spec

from_deepspeed = functools.partial(ds_interop.from_deepspeed, validate=load_spec)  # the CLI's validation


def _deepspeed_config(cfg: dict):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                            **cfg}, mpu=None)


def test_deprecated_cpu_offload_true_still_offloads_the_optimizer():
    cfg = {"zero_optimization": {"stage": 2, "cpu_offload": True}}
    oracle = _deepspeed_config(cfg).zero_config
    assert oracle.offload_optimizer is not None and oracle.offload_optimizer.device == "cpu"
    spec, report = from_deepspeed(cfg)
    assert spec["offload"] == "optimizer" and load_spec(spec).offload == "optimizer"
    off = _deepspeed_config({"zero_optimization": {"stage": 2, "cpu_offload": False}}).zero_config
    assert off.offload_optimizer is None
    assert from_deepspeed({"zero_optimization": {"stage": 2, "cpu_offload": False}})[0].get(
        "offload", "none") == "none"


@pytest.mark.parametrize("force", [True, False, None])
def test_zero_force_ds_cpu_optimizer_means_deepspeeds_cpu_adam_with_offload(force):
    """DeepSpeed (and accelerate) run DeepSpeedCPUAdam with optimizer offload unless the key is
    false; the import says so as deepspeed.cpu_adam, never a silent false."""
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    if force is not None:
        cfg["zero_force_ds_cpu_optimizer"] = force
    assert _deepspeed_config(cfg).zero_force_ds_cpu_optimizer is (force is not False)
    spec, report = from_deepspeed(cfg)
    assert spec["deepspeed"]["cpu_adam"] is (force is not False)
    assert load_spec(spec).deepspeed.cpu_adam is (force is not False)
    without_offload = from_deepspeed({"zero_optimization": {"stage": 2},
                                      "zero_force_ds_cpu_optimizer": True})[0]
    assert "cpu_adam" not in without_offload.get("deepspeed", {})


@pytest.mark.parametrize("block", [
    {"type": "AdamW", "params": {"lr": 3e-5, "torch_adam": True, "adam_w_mode": True,
                                 "weight_decay": 0.01}},
    {"type": "Adam", "params": {"lr": 1e-4, "weight_decay": 0.1}},  # DeepSpeed: decoupled decay
    {"type": "Adam", "params": {"lr": 1e-4, "adam_w_mode": False, "betas": [0.9, 0.95]}},
])
def test_optimizer_hint_is_an_optimizer_torch_builds(block):
    """The report's hint is runnable: torch builds it, and it is the update DeepSpeed's block meant
    (DeepSpeed's "Adam" is AdamW unless adam_w_mode is false)."""
    with pytest.raises(SpecError) as err:
        from_deepspeed({"optimizer": block, "zero_optimization": {"stage": 1}})
    text = " ".join(m for _, m in err.value.problems)
    found = re.search(r"optimizer=\(torch\.optim\.(\w+), (\{.*?\})\)", text)
    assert found, text
    cls, kwargs = getattr(torch.optim, found.group(1)), ast.literal_eval(found.group(2))
    cls([torch.nn.Parameter(torch.zeros(2))], **kwargs)  # torch accepts every argument
    decoupled = block["type"] == "AdamW" or block["params"].get("adam_w_mode", True)
    assert cls is (torch.optim.AdamW if decoupled else torch.optim.Adam)


FSDP1_SHARD_GRAD_OP = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 1
  fsdp_reshard_after_forward: SHARD_GRAD_OP
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
num_processes: 2
"""


def _accelerate_strategy(path: Path) -> str:
    """The sharding strategy `accelerate launch --config_file path` gives FSDP1 (its launcher's
    environment, then its plugin, as a launched script's Accelerator builds it)."""
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args = _validate_launch_command(args)[0]
    with mock.patch("accelerate.utils.launch.is_port_in_use", lambda port: False):
        env = prepare_multi_gpu_env(args)
    with mock.patch.dict(os.environ, env), gpu_host():
        plugin = FullyShardedDataParallelPlugin()
    chosen = plugin.sharding_strategy or plugin.reshard_after_forward  # Accelerator's own rule
    return chosen.name


def test_fsdp1_reshard_after_forward_that_accelerate_drops_is_refused_naming_it(tmp_path):
    """`accelerate config` records FSDP1's strategy as fsdp_reshard_after_forward; accelerate's launcher
    then runs FULL_SHARD anyway. Importing it silently (either way) would hide that: refused, naming
    the field; --lossy keeps what accelerate runs; the file fixed as the error says means grad_op to
    both."""
    path = tmp_path / "accelerate.yaml"
    path.write_text(FSDP1_SHARD_GRAD_OP)
    assert _accelerate_strategy(path) == "FULL_SHARD"
    with pytest.raises(SpecError) as err:
        from_accelerate(yaml.safe_load(path.read_text()), tmp_path)
    (field, message), = err.value.problems
    assert field == "fsdp_config.fsdp_reshard_after_forward" and "runs FULL_SHARD" in message
    assert from_accelerate(yaml.safe_load(path.read_text()), tmp_path, lossy=True)[0]["shard"] == "full"
    fixed = yaml.safe_load(path.read_text())
    fixed["fsdp_config"]["fsdp_sharding_strategy"] = "SHARD_GRAD_OP"
    path.write_text(yaml.safe_dump(fixed))
    assert _accelerate_strategy(path) == "SHARD_GRAD_OP"
    assert from_accelerate(fixed, tmp_path)[0]["shard"] == "grad_op"
