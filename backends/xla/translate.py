"""PyTorch/XLA FSDP's side of the spec, as plain data (no torch_xla import): XlaFullyShardedDataParallel
arguments (v1) or the SPMD FSDPv2 plan (v2), what `polyshard explain` prints; and `local_run`, the same
job laid out for this host's runtime. Its SpecErrors are the backend's validation rules."""

from __future__ import annotations

import os

from parallel.spec.errors import SpecError, merge_native
from parallel.spec.model import Spec

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def _check_reduce(spec: Spec) -> None:
    """v1 reduces in fp32 or in the compute dtype (fp32_reduce_scatter); SPMD v2 reduces the fp32
    gradients of its fp32 parameters in the compiled graph."""
    reduce, x = spec.grad_reduce_dtype, spec.xla
    allowed = {"fp32"} if x.fsdp_version == 2 else {"fp32", spec.precision}
    if reduce not in allowed:
        raise SpecError([("reduce_dtype", f"{spec.reduce_dtype!r} ({reduce}) with precision "
                          f"{spec.precision!r}: XLA FSDP v{x.fsdp_version} reduces gradients in "
                          f"{' or '.join(sorted(allowed))}; use one of those")])


def _check_preemption_sync(spec: Spec) -> None:
    ck = spec.checkpoint
    if not spec.xla.preemption_sync:
        return
    if spec.xla.fsdp_version != 2:
        raise SpecError([("xla.preemption_sync", "is torch_xla's SPMD sync point: set "
                          "xla.fsdp_version: 2, or remove it (v1 agrees through its loss reduction)")])
    if ck.dir is None or ck.preemption_signals != ["SIGTERM"]:
        raise SpecError([("xla.preemption_sync", f"needs checkpoint.dir (got {ck.dir!r}) and "
                          f"checkpoint.preemption_signals: [SIGTERM] (got {ck.preemption_signals}): "
                          "torch_xla's notifier listens to SIGTERM only")])


def _check_spmd_dims(spec: Spec) -> None:
    """tp or cp need SPMD (xla.fsdp_version: 2), which also needs one process per host and
    shard: full: every field that must change is named at once, not one refusal after another."""
    x, t = spec.xla, spec.topology
    if x.fsdp_version != 1:
        return
    problems = [(f"topology.{dim}", f"{degree} with xla.fsdp_version: 1: XLA FSDP v1 wraps plain "
                 f"tensors per process and has no {what} parallelism; use xla.fsdp_version: 2 "
                 f"(SPMD: the mesh's {axis} axis)")
                for dim, degree, what, axis in (("tp", t.tp, "tensor", "model"),
                                                ("cp", t.cp, "context", "seq")) if degree > 1]
    if not problems:
        return
    if t.procs_per_node != 1:
        problems.append(("topology.procs_per_node", f"{t.procs_per_node}: with xla.fsdp_version: 2 "
                         "(which topology.tp / cp need) one process per host drives all its "
                         "devices; set procs_per_node: 1"))
    if spec.shard != "full":
        problems.append(("shard", f"{spec.shard!r}: xla.fsdp_version: 2 (which topology.tp / cp "
                         "need) shards parameters fully; set shard: full"))
    raise SpecError(problems)


def translate(spec: Spec) -> dict:
    _check_reduce(spec)
    _check_preemption_sync(spec)
    x = spec.xla
    settings = {k: v for k, v in x.xla_fsdp_settings.items() if k != "xla_fsdp_grad_ckpt"}
    _check_spmd_dims(spec)
    if x.fsdp_version == 2:
        if spec.topology.procs_per_node != 1:
            raise SpecError([("topology.procs_per_node", f"{spec.topology.procs_per_node} with "
                              "xla.fsdp_version: 2: SPMD runs one process per host that drives all "
                              "its devices; set procs_per_node: 1")])
        if spec.shard != "full":
            raise SpecError([("shard", f"{spec.shard!r} needs xla.fsdp_version: 1: SPMD FSDPv2 "
                              "shards parameters and lets the compiler schedule the gathers; use "
                              "shard: full")])
        tp = spec.topology.tp
        if tp > 1 and x.mesh_shape is not None and x.mesh_shape[1:] != [tp]:
            raise SpecError([("xla.mesh_shape", f"{x.mesh_shape} with topology.tp {tp}: the mesh's "
                              f"model axis is TP; write [devices / {tp}, {tp}] or leave it unset")])
        cp = spec.topology.cp
        if cp > 1 and x.mesh_shape is not None:
            raise SpecError([("xla.mesh_shape", f"{x.mesh_shape} with topology.cp {cp}: the mesh is "
                              "(fsdp, seq, model) = (devices / (cp x tp), cp, tp); leave it unset")])
        default = "all devices x 1" if tp == 1 else f"devices / {tp} x {tp}"
        axes = ["fsdp", "model"]
        if cp > 1:  # rows split over seq; the compiler partitions attention over it
            default, axes = f"devices / {cp * tp} x {cp} x {tp}", ["fsdp", "seq", "model"]
        return {"api": "SpmdFullyShardedDataParallel", "mesh": x.mesh_shape or default,
                "mesh_axes": axes, "autocast": DTYPE_NAMES[spec.precision],
                "activation_checkpointing": spec.checkpoint_activations,
                "kwargs": {**settings, **x.native}}
    mixed = spec.precision != "fp32"
    kwargs = {"reshard_after_forward": spec.shard == "full",
              "flatten_parameters": x.flatten_parameters,
              "compute_dtype": DTYPE_NAMES[spec.precision],
              "buffer_dtype": "float32",
              "fp32_reduce_scatter": mixed and spec.grad_reduce_dtype == "fp32"}
    origins = {"reshard_after_forward": "shard", "flatten_parameters": "xla.flatten_parameters",
               "compute_dtype": "precision", "fp32_reduce_scatter": "reduce_dtype"}
    kwargs = merge_native(kwargs, origins, settings, "xla.xla_fsdp_settings")
    kwargs = merge_native(kwargs, origins, x.native, "xla.native")
    return {"api": "XlaFullyShardedDataParallel", "kwargs": kwargs,
            "activation_checkpointing": spec.checkpoint_activations}


def local_run(spec: Spec, devices: int | None = None) -> tuple[dict, dict]:
    """The same job on one host's CPU client (PJRT_DEVICE=CPU), which is single-process. Where the
    spec leaves xla.fsdp_version unwritten and its shard level is SPMD's (full), the CPU layout is
    v2: one process over `world_size` virtual devices (CPU_NUM_DEVICES), sharded as asked. Where it
    writes fsdp_version: 1 (or needs v1: grad_op), v1 runs at world size 1 with the whole global
    batch in its micro-batches. The global batch is unchanged either way; `polyshard launch` says
    which in one line. Other devices run the spec as written."""
    from parallel.envinfo import detect_pjrt_device

    data = spec.model_dump(mode="json", exclude_unset=True)
    if detect_pjrt_device() != "CPU":
        return data, {}
    world = devices or spec.world_size
    data["topology"] = {**data.get("topology", {}), "nodes": 1, "procs_per_node": 1}
    written = "fsdp_version" in spec.xla.model_fields_set
    if not written and world > 1 and spec.shard == "full":
        data["xla"] = {**data.get("xla", {}), "fsdp_version": 2}
    if data.get("xla", {}).get("fsdp_version", spec.xla.fsdp_version) == 1:
        data["micro_batch_size"] = spec.micro_batch_size * world
        return data, {"CPU_NUM_DEVICES": "1"}
    if devices is None and spec.world_size == 1:
        # one SPMD process as written: its devices are the runtime's (CPU_NUM_DEVICES as the user
        # set it), not ours to override; unset, the fewest that hold the model dimensions (tp: 2
        # on one CPU device failed at launch, naming nothing to set)
        model_dims = spec.topology.tp * spec.topology.cp
        if model_dims > 1 and "CPU_NUM_DEVICES" not in os.environ:
            return data, {"CPU_NUM_DEVICES": str(model_dims)}
        return data, {}
    return data, {"CPU_NUM_DEVICES": str(world)}
