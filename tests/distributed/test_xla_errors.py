"""Multi-device XLA FSDP v1 on the CPU client is refused with an explanation, not a hang or abort."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch_xla")
pytestmark = pytest.mark.distributed

CODE = "from parallel import create_engine, load_spec; " \
       "create_engine(load_spec({'backend': 'xla_fsdp', 'xla': {'fsdp_version': 1}}))"


@pytest.mark.timeout(120)
def test_v1_with_two_cpu_devices_is_a_clear_error():
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env,
                         timeout=100)
    assert out.returncode != 0
    assert "CPU client is single-process" in out.stderr and "fsdp_version: 2" in out.stderr
