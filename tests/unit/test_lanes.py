"""A backend's ranks start in its lane's Python where its packages live apart (torch_xla 2.9.0 needs
torch 2.9.0; parallel/launch/lanes.py), named by POLYSHARD_PYTHON_<EXTRA>; everything else here."""

import importlib.util
import sys

import pytest

from parallel.launch import lanes
from parallel.launch.torchrun import LaunchArgs, torchrun_command
from parallel.spec.io import load_spec


def test_a_backend_whose_packages_import_here_runs_here(monkeypatch):
    monkeypatch.setenv("POLYSHARD_PYTHON_XLA", "/nonexistent/python")
    assert lanes.interpreter("fsdp") == sys.executable


def test_a_backend_whose_packages_do_not_import_runs_in_its_named_lane(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch_xla" else real(name, *a))
    monkeypatch.delenv("POLYSHARD_PYTHON_XLA", raising=False)
    assert lanes.interpreter("xla_fsdp") == sys.executable and not lanes.available("xla_fsdp")
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.setenv("POLYSHARD_PYTHON_XLA", str(python))
    assert lanes.interpreter("xla_fsdp") == str(python) and lanes.available("xla_fsdp")
    spec = load_spec({"backend": "xla_fsdp", "xla": {"fsdp_version": 2}})
    assert torchrun_command(spec, LaunchArgs(), "train.py", [])[0] == str(python)
    assert torchrun_command(load_spec({"backend": "fsdp"}), LaunchArgs(), "t.py", [])[0] == \
        sys.executable
    python.chmod(0o644)
    with pytest.raises(ValueError, match="POLYSHARD_PYTHON_XLA=.*not an executable file"):
        lanes.interpreter("xla_fsdp")


READ_INDEX = ("import sys; from pathlib import Path; from parallel.checkpoint.format.safe import "
              "load_index; print(load_index(Path(sys.argv[1]) / '.metadata').state_dict_metadata["
              "'w'].size)")


def test_a_dcp_index_this_torch_writes_reads_in_the_xla_lane(tmp_path):
    """torch 2.15 pickles DCP's TensorProperties with a sixth field (strides); the XLA lane's torch
    2.9 unpacked five and refused the index ('too many values to unpack'): a checkpoint saved in
    the main lane did not resume on XLA."""
    import os
    import subprocess

    import torch
    import torch.distributed.checkpoint as dcp

    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("torch_xla imports here: this is the XLA lane, the main lane's test reads into it")
    xla = lanes.lane_of("torch_xla")
    if xla is None:
        pytest.skip("the XLA lane's python is not named (POLYSHARD_PYTHON_XLA; make sets it)")
    dcp.save({"w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(tmp_path), no_dist=True)
    out = subprocess.run([xla, "-c", READ_INDEX, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0 and out.stdout.strip().endswith("torch.Size([2, 3])"), out.stderr[-2000:]
