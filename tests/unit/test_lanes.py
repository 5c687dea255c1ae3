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
