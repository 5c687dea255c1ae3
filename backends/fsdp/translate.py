"""torch FSDP's side of the spec, as plain data: the fully_shard (v2) or FullyShardedDataParallel (v1)
keyword arguments a spec means (what `polyshard explain` prints). Its SpecErrors are the backend's
validation rules (parallel/descriptor.py): every spec that reaches an engine passed them."""

from __future__ import annotations

from parallel.spec.errors import SpecError, merge_native
from parallel.spec.pipeline import TWO_STAGES as V_SHAPED
from parallel.spec.dims import HYBRID
from parallel.spec.model import Spec

LOW = ("bf16", "fp16")  # compute dtypes FSDP casts parameters to (fp32: no cast)
FSDP1_STRATEGY = {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD_OP", "none": "NO_SHARD",
                  "hybrid": "HYBRID_SHARD", "hybrid_grad_op": "_HYBRID_SHARD_ZERO2"}


def mesh_shape(spec: Spec) -> tuple[int, ...]:
    """The data-parallel mesh FSDP shards over (parallel/spec/dims.py): (replicas, shard group)
    for hybrid, and for `none`, which on FSDP2 is a hybrid mesh whose shard groups have one rank
    (every rank keeps everything, gradients are all-reduced: DDP); the shard group alone otherwise."""
    dims = spec.dims
    if spec.shard in HYBRID or spec.shard == "none":
        return (dims.dp_replicate, dims.dp_shard)
    return (dims.dp_shard,)


def _check_loss_scale(spec: Spec) -> None:
    deepspeed_only = {"hysteresis", "min_scale"} & spec.loss_scale.model_fields_set
    if spec.precision == "fp16" and deepspeed_only:
        raise SpecError([(f"loss_scale.{k}", "torch's ShardedGradScaler has no such knob (it halves "
                          "the scale on every overflow); remove it or use backend: deepspeed")
                         for k in sorted(deepspeed_only)])


def _ep_rules(spec: Spec) -> None:
    """topology.ep: FSDP2's experts split (parallel/engine/model/moe/expert_parallel.py); FSDP1
    cannot shard one expert over its own ranks."""
    ep = spec.topology.ep
    if ep == 1:
        return
    if spec.fsdp.version == 1:
        raise SpecError([("topology.ep", f"{ep} with fsdp.version: 1: each expert is sharded over "
                          "its own ranks, which FSDP1's one process group per unit cannot do; "
                          "use fsdp.version: 2")])


def _device_rules(spec: Spec) -> None:
    """topology.device: tpu is TorchTPU's device, which runs FSDP2 and DTensor on
    DeviceMesh("tpu"); FSDP1's flat parameters and its CUDA streams are not ported to it."""
    if spec.topology.device == "tpu" and spec.fsdp.version == 1:
        raise SpecError([("topology.device", "'tpu' with fsdp.version: 1: TorchTPU runs "
                          "fully_shard (FSDP2) and DTensor, not FSDP1's flat parameters; use "
                          "fsdp.version: 2")])


def _float8_rules(spec: Spec) -> None:
    """float8.all_gather is FSDP2's tensor-subclass hook over sharded parameters."""
    if not spec.float8.all_gather or spec.precision != "fp8":
        return
    if spec.fsdp.version == 1:
        raise SpecError([("float8.all_gather", "true with fsdp.version: 1: FSDP1 gathers flat "
                          "parameters, which torchao's float8 all-gather does not hook; use "
                          "fsdp.version: 2 or float8.all_gather: false")])
    if spec.shard == "none":
        raise SpecError([("float8.all_gather", "true with shard: none: nothing is gathered; use "
                          "float8.all_gather: false")])


def _fsdp2_dims(spec: Spec) -> None:
    """tp, cp, pp and ep are FSDP2's: fully_shard's mesh spans them, FSDP1's flat parameters do
    not."""
    _ep_rules(spec)
    if spec.fsdp.version == 2:
        if spec.topology.pp > 1 and spec.pipeline.schedule in V_SHAPED:
            raise SpecError([("pipeline.schedule", f"{spec.pipeline.schedule!r} with fully_shard: "
                              "torch 2.9 runs V-shaped schedules over FSDP2 stages with wrong "
                              "gradients (measured against one process: zbv's last stage gets "
                              "none, dualpipev's is 6% off; tests/distributed/pipeline_v_worker.py "
                              "reproduces it in plain torch); use interleaved_1f1b (docs/pipeline.md)")])
        if spec.topology.pp > 1 and spec.fsdp.cpu_ram_efficient_loading:
            raise SpecError([("fsdp.cpu_ram_efficient_loading", f"true with topology.pp "
                              f"{spec.topology.pp}: rank 0 holds the first stage only, so it "
                              "cannot send every stage its weights; set it false (each rank builds "
                              "the model and keeps its stages)")])
        return
    if spec.topology.pp > 1:
        raise SpecError([("topology.pp", f"{spec.topology.pp} with fsdp.version: 1: torch's "
                          "pipeline stages run under fully_shard (FSDP2) only; use fsdp.version: 2")])
    if spec.topology.tp > 1:
        raise SpecError([("topology.tp", f"{spec.topology.tp} with fsdp.version: 1: FSDP1's flat "
                          "parameters cannot hold DTensor shards of a tensor-parallel split; use "
                          "fsdp.version: 2 (fully_shard over the data-parallel dims, TP innermost)")])
    if spec.topology.cp > 1:
        raise SpecError([("topology.cp", f"{spec.topology.cp} with fsdp.version: 1: FSDP1's flat "
                          "parameters are sharded over one process group per unit and polyshard "
                          "splits sequences only under fully_shard, whose mesh spans data and "
                          "context parallel ranks; use fsdp.version: 2")])


def translate(spec: Spec) -> dict:
    """The FSDP keyword arguments this spec means, as plain values, with `fsdp.native` merged last."""
    for rules in (_check_loss_scale, _device_rules, _float8_rules):
        rules(spec)
    low = spec.compute if spec.compute in LOW else None
    reduce = spec.grad_reduce_dtype
    mixed = {"param_dtype": low, "reduce_dtype": reduce} if low or reduce != "fp32" else None
    _fsdp2_dims(spec)
    if spec.fsdp.version == 2:
        kwargs = {"reshard_after_forward": spec.shard in ("full", "hybrid")}
        origins = {"reshard_after_forward": "shard"}
        if mixed:
            kwargs["mp_policy"] = mixed
            origins["mp_policy"] = "precision / reduce_dtype"
        if spec.offload == "params":
            kwargs["offload_policy"] = {"pin_memory": spec.pin_memory}
            origins["offload_policy"] = "offload / pin_memory"
        native = merge_native(kwargs, origins, spec.fsdp.native, "fsdp.native")
        out = {"api": "fully_shard", "mesh": list(mesh_shape(spec)), "kwargs": native}
        if spec.topology.tp > 1:  # parallelize_module over mesh["tp"] first (backends/fsdp/parallelize.py)
            out["tp"] = {"size": spec.topology.tp, "plan": spec.topology.tp_plan or "model's own"}
        if spec.topology.cp > 1:  # sharded over dp_shard x cp; attention's all-to-all over cp
            out["cp"] = {"size": spec.topology.cp, "attention": "ulysses all-to-all",
                         "shard_mesh": "dp_shard x cp"}
        if spec.topology.ep > 1:  # experts split over ep, each sharded over what ep leaves
            out["ep"] = {"size": spec.topology.ep, "dispatch": "all-to-all",
                         "experts_shard_mesh": "dp_replicate x dp_mod_ep"
                         if len(out["mesh"]) == 2 else "dp_mod_ep"}
        return out
    f = spec.fsdp
    if spec.shard in HYBRID and spec.shard_group_size == 1:
        # Measured (docs/fsdp.md): FSDP1 clamps a 1-rank process group to NO_SHARD, and in hybrid
        # mode that group is the shard group, so gradients are never all-reduced across replicas.
        raise SpecError([("topology.shard_group_size", "1 with FSDP1 hybrid sharding silently "
                          "trains each replica alone (torch clamps a 1-rank shard group to NO_SHARD "
                          "and skips the replica all-reduce); use `shard: none` for pure replication, "
                          "a shard_group_size > 1, or `fsdp.version: 2`")])
    if spec.offload == "params" and not spec.pin_memory:
        raise SpecError([("pin_memory", "false with fsdp.version: 1: FSDP1 always pins offloaded "
                          "shards (CPUOffload has no switch); use fsdp.version: 2 or pin_memory: "
                          "true")])
    kwargs = {"sharding_strategy": FSDP1_STRATEGY[spec.shard], "backward_prefetch":
              None if f.backward_prefetch == "none" else f.backward_prefetch.upper(),
              "forward_prefetch": f.forward_prefetch, "sync_module_states": f.sync_module_states,
              "use_orig_params": f.use_orig_params, "limit_all_gathers": f.limit_all_gathers,
              "cpu_offload": spec.offload == "params"}
    origins = {"sharding_strategy": "shard", "cpu_offload": "offload"}
    origins.update({k: f"fsdp.{k}" for k in kwargs if k not in origins})
    if mixed:
        kwargs["mixed_precision"] = mixed
        origins["mixed_precision"] = "precision / reduce_dtype"
    native = merge_native(kwargs, origins, f.native, "fsdp.native")
    if spec.compile.enabled and not native["use_orig_params"]:
        # Dynamo traces the original parameters; FSDP1's flat parameter hides them behind views
        # that change storage every forward (torch documents use_orig_params=True for compile).
        raise SpecError([("fsdp.use_orig_params", "false with compile.enabled: torch.compile "
                          "needs FSDP1's original parameters; set use_orig_params: true, or "
                          "compile.enabled: false")])
    mesh = list(mesh_shape(spec)) if spec.shard in HYBRID else None
    return {"api": "FullyShardedDataParallel", "mesh": mesh, "kwargs": native}
