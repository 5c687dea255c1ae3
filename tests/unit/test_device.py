"""topology.device (parallel/kits/device.py): the device a rank trains on, through torch's
device-generic APIs, so CUDA and TorchTPU's tpu device take the same code. On this CPU host: what
`auto` resolves to, the refusals naming the field and what installs the device, the backends and
options that cannot run TorchTPU (refused at validation, from the registry), and the launch's use
of TorchTPU's own launch environment."""

import pytest
import torch

from parallel.kits import device as devices
from parallel.launch.torchrun import LaunchArgs, _rendezvous
from parallel.spec.errors import SpecError
from parallel.spec.io import load_spec


def test_auto_is_the_cpu_here_and_a_named_device_this_host_lacks_is_refused_by_name():
    assert devices.accelerator() is None and devices.resolve("auto") == "cpu"
    assert devices.resolve("cpu") == "cpu"
    with pytest.raises(SpecError) as err:
        devices.resolve("tpu")
    (path, message), = err.value.problems
    assert path == "topology.device" and "'tpu': torch_tpu is not installed" in message
    assert "polyshard[torchtpu]" in message and "topology.device: auto (here: cpu)" in message
    with pytest.raises(SpecError, match="'cuda': torch.accelerator finds no accelerator"):
        devices.resolve("cuda")


def test_auto_follows_torch_accelerator(monkeypatch):
    """Where TorchTPU registered its device (a TPU VM), torch.accelerator names it: auto takes it,
    and the process group pairs gloo with the backend torch maps the device to."""
    monkeypatch.setattr(devices, "accelerator", lambda: "tpu")
    assert devices.resolve("auto") == "tpu" and devices.resolve("tpu") == "tpu"
    monkeypatch.setattr(devices, "accelerator", lambda: "cuda")
    assert devices.resolve("auto") == "cuda"
    with pytest.raises(SpecError, match=r"torch_tpu is not installed.*\(here: cuda\)"):
        devices.resolve("tpu")


def test_the_cpu_binds_gloo_and_records_no_events():
    device, backend = devices.bind("cpu", 0)
    assert device == torch.device("cpu") and backend == "gloo"
    assert devices.recorded_event(device) is None and not devices.on_accelerator(device)
    assert devices.launch_env("cpu", 2, 8) == {} and devices.launch_env("cuda", 2, 8) == {}


@pytest.mark.parametrize("changes, path, words", [
    ({"backend": "deepspeed"}, "topology.device", "no accelerator for TorchTPU"),
    ({"backend": "xla_fsdp"}, "topology.device", "through torch_xla's PJRT client"),
    ({"fsdp": {"version": 1}}, "topology.device", "not FSDP1's flat parameters"),
    ({"compile": True}, "compile.backend", "raises on inductor for TPU tensors"),
])
def test_what_cannot_run_torchtpu_is_refused_at_validation(changes, path, words):
    data = {"topology": {"device": "tpu"}, **changes}
    with pytest.raises(SpecError) as err:
        load_spec(data)
    assert any(p == path and words in m for p, m in err.value.problems), err.value.problems


def test_torchtpu_compiles_with_its_own_backend_only():
    spec = load_spec({"topology": {"device": "tpu"}, "compile": {"enabled": True,
                                                                 "backend": "tpu"}})
    assert spec.topology.device == "tpu" and spec.compile.backend == "tpu"
    with pytest.raises(SpecError, match="compile.backend: 'tpu' with topology.device: auto"):
        load_spec({"compile": {"backend": "tpu"}})


def test_launch_refuses_a_device_this_host_lacks_before_any_rank_starts(capsys):
    from parallel.cli.main import main

    assert main(["launch", "--set", "topology.device=tpu", "configs/demo.yaml",
                 "examples/train_lm.py"]) == 2
    assert "topology.device: 'tpu': torch_tpu is not installed" in capsys.readouterr().err


def test_torchtpus_rendezvous_is_used_where_nothing_names_one():
    """set_tpu_launch_env's NODE_RANK / MASTER_ADDR (measured with torch-tpu 0.2.0 on a two-host
    TPU_WORKER_HOSTNAMES: docs/tpu.md); the command line and the spec's rdzv_endpoint win."""
    runtime = {"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}
    assert _rendezvous(LaunchArgs(), runtime, None) == LaunchArgs(1, "10.0.0.5:29500")
    assert _rendezvous(LaunchArgs(), runtime, "h:1").rdzv_endpoint == "h:1"
    assert _rendezvous(LaunchArgs(0, "a:2"), runtime, None) == LaunchArgs(0, "a:2")
    single = {"TORCH_TPU_TOPOLOGY": "2,2,1"}  # one host: torchrun's --standalone, unchanged
    assert _rendezvous(LaunchArgs(), single, None) == LaunchArgs()
