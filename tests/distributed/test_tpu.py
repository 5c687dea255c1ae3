"""TorchTPU's tpu device (topology.device: tpu, FSDP2): the cases test_gpu.py runs on CUDA, on the
chips of a TPU VM through the same device-generic code (torch.accelerator, torch.Event, the tpu_dist
process group, DeviceMesh("tpu")). One process per chip, at most 4. Skipped where TorchTPU has not
registered its device (no torch-tpu, or no TPU chips: docs/tpu.md); benchmarks/tpu_check.sh runs it
first on a TPU VM. Not yet run on TPU hardware."""

import json

import pytest
from harness import ROOT, case, check_parity, run_parity, torchrun

from parallel.kits.device import accelerator

BUDGET_S = 30  # seconds in make test (tests/conftest.py): skipped on CPU hosts

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(accelerator() != "tpu",
                                 reason="needs TorchTPU's tpu device (torch-tpu on a TPU VM)")]
TOL = 1e-5  # fp32 against the CPU reference: what every backend meets (docs/tpu.md: not measured)


def chips() -> int:
    import torch

    return min(torch.accelerator.device_count(), 4)


def spec(**data):
    return {"topology": {"procs_per_node": chips(), "device": "tpu"}, "micro_batch_size": 2,
            **data}


@pytest.mark.timeout(600)
def test_tpu_parity_fsdp2_against_one_cpu_process(tmp_path):
    cases = [case("fsdp2-full", spec(backend="fsdp"), optimizer="adamw"),
             case("fsdp2-grad-op", spec(backend="fsdp", shard="grad_op"), optimizer="adamw")]
    results = run_parity(tmp_path, cases, nproc=chips(), timeout=550)
    for c in cases:
        diff = check_parity(c["name"], results[c["name"]], tol=TOL)
        print(f"{c['name']}: max |loss - CPU reference| {diff:.2e}")


@pytest.mark.timeout(600)
def test_tpu_async_save_holds_its_step(tmp_path):
    """checkpoint.async_save staged from TPU memory: the resumed losses equal the uninterrupted
    ones and `latest` names the async save (blocking times printed, not asserted)."""
    cases = {"fsdp2": spec(backend="fsdp"),
             "fsdp2-thread": spec(backend="fsdp", checkpoint={"async_writer": "thread"})}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    torchrun(chips(), [str(ROOT / "tests" / "distributed" / "async_worker.py"), "--root",
                       str(tmp_path / "ckpt"), "--out", str(tmp_path / "out.json"),
                       "--cases", str(tmp_path / "cases.json")], 550)
    for name, r in json.loads((tmp_path / "out.json").read_text()).items():
        assert r["step"] == 3 and r["latest"] == "async-1", r
        assert r["resumed"] == r["losses"][3:], (name, r["resumed"], r["losses"])
        print(f"{name}: sync save {min(r['sync_save_s']):.3f} s, async blocks "
              f"{min(r['async_blocking_s']):.3f} s")
