"""CUDA + NCCL paths: the same parity cases with the device code paths CPU runs cannot reach
(NCCL process groups, FSDP1's own sync_module_states and pinned CPU offload, rank-0-only full state
dicts, DeepSpeed's CUDA accelerator). Skipped on machines without a GPU."""

import pytest
import torch
from harness import case, check_parity, run_parity

pytestmark = [pytest.mark.distributed, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA and NCCL; this machine has no GPU")]


def gpus() -> int:
    return min(torch.cuda.device_count(), 2)


def spec(**data):
    return {"topology": {"procs_per_node": gpus()}, "micro_batch_size": 2, **data}


@pytest.mark.timeout(600)
def test_cuda_parity_fsdp_and_deepspeed(tmp_path):
    cases = [
        case("fsdp2-full", spec(backend="fsdp"), optimizer="adamw"),
        case("fsdp1-offload-sync", spec(backend="fsdp", offload="params",
                                        fsdp={"version": 1, "sync_module_states": True}),
             optimizer="adamw"),
        case("fsdp1-full-state-dict", spec(backend="fsdp", state_dict="full",
                                           fsdp={"version": 1}), optimizer="adamw"),
        case("fsdp1-ram-efficient", spec(backend="fsdp", fsdp={
            "version": 1, "cpu_ram_efficient_loading": True}), optimizer="adamw", factory=True),
        case("zero3", spec(backend="deepspeed", shard="full"), optimizer="adamw"),
        case("zero2-offload", spec(backend="deepspeed", shard="grad_op", offload="optimizer"),
             optimizer="adamw"),
    ]
    # TF32 would make matmuls differ from the fp32 reference by more than 1e-5.
    env = {"NVIDIA_TF32_OVERRIDE": "0"}
    results = run_parity(tmp_path, cases, nproc=gpus(), timeout=550, env=env)
    for c in cases:
        check_parity(c["name"], results[c["name"]], tol=1e-4)
