"""Everything polyshard knows about torch FSDP (parallel/descriptor.py), without importing the engine."""

from __future__ import annotations

from backends.fsdp import accelerate, exports, plan
from backends.fsdp.translate import translate
from backends.fsdp.options import FsdpOptions
from parallel.descriptor import (BackendDescriptor, Bench, Capabilities, Interop, Launch,
                                 Options, PlanModel, Unsupported)

NATIVE_STAGE = {"full": 3, "grad_op": 2}  # benchmarks/native_fsdp{1,2}.py: reshard after forward or not


def native_loop(spec):
    """benchmarks/'s hand-written loop for `spec`: native_fsdp{1,2}.py (with torchtitan's apply_tp
    at tp > 1), native_pipeline.py at pp > 1 (torchtitan's pipelining), native_ep.py at ep > 1
    (torchtitan's expert parallelism); none with cp (torchtitan's context parallelism is ring
    attention on CUDA SDPA); with precision: fp8, native_fsdp2.py --fp8 (torchtitan's float8)."""
    t = spec.topology
    if t.cp > 1 or (t.pp > 1 and t.tp > 1):
        return None
    if t.ep > 1:  # torchtitan's token dispatch and expert sharding, by hand
        return "native_ep.py", [f"--ep={t.ep}", f"--stage={NATIVE_STAGE.get(spec.shard, 0)}"]
    if t.pp > 1:
        p = spec.pipeline
        return "native_pipeline.py", [f"--pp={t.pp}", f"--schedule={p.schedule}",
                                      f"--microbatches={p.microbatches or spec.micro_batch_size}"]
    if spec.precision == "fp8":  # torchtitan's float8 loop: FSDP2, data parallel, all-gather
        if spec.fsdp.version != 2 or t.tp > 1 or not spec.float8.all_gather:
            return None
        return "native_fsdp2.py", [f"--stage={NATIVE_STAGE.get(spec.shard, 0)}", "--fp8"]
    return f"native_fsdp{spec.fsdp.version}.py", [
        f"--stage={NATIVE_STAGE.get(spec.shard, 0)}", *([f"--tp={t.tp}"] if t.tp > 1 else [])]


DESCRIPTOR = BackendDescriptor(
    name="fsdp",
    summary="torch FSDP: FSDP2 fully_shard (default) or FSDP1 FullyShardedDataParallel",
    capabilities=Capabilities(unsupported={
        "shard": {"optimizer": Unsupported(
            "torch FSDP has no optimizer-state-only sharding (that is ZeRO-1)",
            "shard: grad_op (shards gradients and optimizer state), or backend: deepspeed")},
        "offload": {"optimizer": Unsupported(
            "torch FSDP offloads parameters, gradients and optimizer state together",
            "offload: params, or backend: deepspeed for optimizer-only offload")},
    }),
    translate=translate,
    engine="backends.fsdp.engine:make_engine",
    # FSDP2 only: translate refuses them with version 1
    dimensions=frozenset({"tp", "cp", "pp", "ep"}),
    options=Options("fsdp", FsdpOptions, "torch FSDP only knobs."),
    variants={"fsdp2": {"fsdp": {"version": 2}}, "fsdp1": {"fsdp": {"version": 1}}},
    plan=PlanModel(plan.model_states, plan.comm, plan.transient),
    # accelerate and transformers import torch_xla whenever it is installed, and accelerate then
    # picks XLA even under torchrun unless USE_TORCH_XLA=0
    launch=Launch(env=lambda: {"USE_TORCH_XLA": "0"}),
    interop=Interop(
        exports={"accelerate": exports.to_accelerate, "hf-trainer": exports.to_hf_trainer},
        accelerate_claims=accelerate.claims,
        accelerate_section=accelerate.section),
    bench=Bench(dryrun={"fsdp": {"sync_module_states": False, "cpu_ram_efficient_loading": False}},
                native=native_loop),
)
