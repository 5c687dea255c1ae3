"""torch FSDP's model set-up as torchtitan composes it (parallelize_llama): one function per step, each
taking the model, the mesh or the units, and plain options, each testable alone on a meta-device model
(tests/unit/test_fsdp_apply.py). engine.py calls them in the order its comments give.

- `apply_tp`: the tensor-parallel plan over mesh["tp"] (topology.tp; the plan and its checks:
  parallel/engine/model/tp_plan.py);
- `apply_fsdp2` / `apply_fsdp1`: the shard units, the model's edges (layout.py) and the root;
- `apply_expert_fsdp`: topology.ep's experts, each a unit over the ranks holding the same ones;
- `apply_forward_prefetch`: FSDP2's explicit forward prefetch in forward order;
- `sync_from_rank0`, `full_state_of`, `fill_from_rank0`: every rank starting from rank 0's weights
  (sync_module_states, cpu_ram_efficient_loading).
"""

from __future__ import annotations

import functools
import inspect
from fnmatch import fnmatch
from itertools import chain

import torch
import torch.distributed as dist
from torch import nn

from backends.fsdp.layout import edge_units
from parallel.engine.model.params import Sharded
from parallel.kits.names import clean_name
from parallel.engine.model.tp_plan import STYLES
from parallel.spec.errors import SpecError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fp32 / None: no cast


def parallel_style(style: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "colwise_rep":  # the head: vocabulary split, logits gathered whole for the loss
        return ColwiseParallel(output_layouts=Replicate())
    raise ValueError(f"tp plan style {style!r}: polyshard knows {', '.join(STYLES)}")


def apply_tp(model: nn.Module, tp_mesh, plan: dict[str, str]) -> None:
    """Split the plan's modules over `tp_mesh` in place. Heads are split, so each rank's attention
    sees num_heads / tp heads: transformers' attention reshapes with -1 heads and runs as is.
    torchtitan's order: before fully_shard, which then shards the TP shards again over the
    data-parallel dims (`_StridedShard`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    # src_data_rank=None: each rank keeps its own chunk, no scatter from the TP group's first
    # rank. Every rank holds the same weights already (one seed, or sync_module_states' broadcast),
    # as fully_shard assumes too; and with cpu_ram_efficient_loading the ranks but 0 hold meta
    # tensors that cannot join a scatter (measured: the default scatter hung ranks 0-1 of 4).
    # precision: fp8 (tensorwise): torchao's float8 styles for converted layers (float8.py); a
    # plan's path may be a pattern (layers.*.q_proj), matched as parallelize_module matches it
    from parallel.engine.model.float8 import float8_style, is_float8

    def converted(path: str) -> bool:
        return any(is_float8(m) for n, m in model.named_modules() if fnmatch(n, path))

    styles = {path: float8_style(s) if converted(path) else parallel_style(s)
              for path, s in plan.items()}
    parallelize_module(model, tp_mesh, styles, src_data_rank=None)


def fsdp2_kwargs(plain: dict, device_type: str) -> dict:
    """translate.py's plain fully_shard arguments as torch's objects, checked against its
    signature (a `native:` key it does not take is refused naming it)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = dict(plain)
    if "mp_policy" in kwargs:
        mp = kwargs["mp_policy"]
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES.get(mp["param_dtype"]),
                                                   reduce_dtype=DTYPES.get(mp["reduce_dtype"],
                                                                           torch.float32))
    if isinstance(kwargs.get("offload_policy"), dict):
        # pinning needs a CUDA driver; on a CPU-only host there is nothing to pin
        pin = kwargs["offload_policy"]["pin_memory"] and device_type == "cuda"
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
    check_kwargs(fully_shard, kwargs)
    return kwargs


def shard_mesh(mesh, hybrid: bool, cp: int):
    """The slice of the engine's mesh fully_shard works over: the shard group, and the replicas
    around it where `hybrid`. With cp the shard group is dp_shard x cp flattened (torchtitan's
    "dp_shard_cp"): a cp group's ranks hold other tokens of the same rows, so their gradients
    reduce together exactly as data-parallel ranks' do, and sharding over them too divides the
    model's memory by cp as well."""
    shard = "dp_shard"
    if cp > 1:
        shard = "dp_shard_cp"
        mesh["dp_shard", "cp"]._flatten(shard)
    return mesh["dp_replicate", shard] if hybrid else mesh[shard]


def apply_fsdp2(model: nn.Module, units: list[tuple[str, nn.Module]], mesh, kwargs: dict,
                reshard_output: bool) -> None:
    """fully_shard each unit (children first: each owns only what no inner unit owns), the edges as
    torchtitan shards them (layout.py), then the root without an explicit reshard_after_forward:
    torch keeps it unsharded, so nothing is gathered twice per step. `units`: what sits at each
    unit's place (the checkpoint wrapper when there is one: FSDP's hooks stay outside the
    recomputed region and the compiled graph)."""
    from torch.distributed.fsdp import fully_shard

    kwargs = dict(kwargs)
    for _, unit in units:
        fully_shard(unit, mesh=mesh, **kwargs)
    blocks_reshard = kwargs.pop("reshard_after_forward")
    for modules, like_blocks in edge_units(model, units):
        keep = blocks_reshard if like_blocks else reshard_output
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh,
                    reshard_after_forward=keep, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)


def apply_expert_fsdp(experts: list[nn.Module], mesh, kwargs: dict, divide_by: int,
                      device_type: str) -> None:
    """topology.ep: each held expert its own unit over `mesh` (the ranks holding the same experts),
    before the blocks (children first: the blocks' units leave the experts' parameters to them),
    as torchtitan shards experts over dp_shard_mod_ep. The gradient is divided by the whole
    data-parallel x cp count, not the mesh's size: each owner's gradient already sums its ep
    group's tokens (torchtitan's gradient divide factor). NCCL folds the division into the
    reduction (premul-sum); elsewhere (gloo) it is a sum, then the division. Where the shard
    dimension has one rank (no other rank shards the same experts) there is no reduce-scatter:
    torch 2.15 divides in the copy that replaces it, and with forced sums divides again after the
    replicas' all-reduce or alone (expert gradients at half of one process's, measured), so the
    sums are forced only where a reduce-scatter runs."""
    from torch.distributed.fsdp import fully_shard

    for expert in experts:
        fully_shard(expert, mesh=mesh, **kwargs)
        expert.set_gradient_divide_factor(float(divide_by))
        if device_type != "cuda" and mesh.shape[-1] > 1:
            expert.set_force_sum_reduction_for_comms(True)


def apply_forward_prefetch(model: nn.Module, units: list[tuple[str, nn.Module]]) -> None:
    """fsdp.forward_prefetch: each unit prefetches the next one in forward order. Forward runs units
    in module pre-order. plan_wrap lists them children first, which is reversed pre-order for class
    policies but post-order for the size policy: sort, never reverse (a reversed post-order made
    each unit prefetch the one that ran before it)."""
    position = {id(m): i for i, m in enumerate(model.modules())}
    forward_order = sorted((m for _, m in units), key=lambda m: position[id(m)])
    for this, nxt in zip(forward_order, forward_order[1:]):
        this.set_modules_to_forward_prefetch([nxt])


def fsdp1_kwargs(plain: dict, device: torch.device, mesh) -> dict:
    """translate.py's plain FullyShardedDataParallel arguments as torch's objects. `mesh`: the
    (replicas, shard group) mesh of a hybrid strategy, else None."""
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy

    kwargs = dict(plain)
    kwargs["sharding_strategy"] = ShardingStrategy[kwargs["sharding_strategy"]]
    if kwargs["backward_prefetch"]:
        kwargs["backward_prefetch"] = BackwardPrefetch[kwargs["backward_prefetch"]]
    # torch 2.9's FSDP1 pins offloaded shards, which needs a CUDA driver; on a CPU device the
    # parameters already live in CPU memory, which is what `offload: params` asks for.
    kwargs["cpu_offload"] = CPUOffload(offload_params=kwargs["cpu_offload"]
                                       and device.type != "cpu")
    if "mixed_precision" in kwargs:
        mp = kwargs["mixed_precision"]
        kwargs["mixed_precision"] = MixedPrecision(
            param_dtype=DTYPES.get(mp["param_dtype"]),
            reduce_dtype=DTYPES.get(mp["reduce_dtype"], torch.float32))
    if mesh is not None:
        kwargs["device_mesh"] = mesh
    return kwargs


def apply_fsdp1(model: nn.Module, units: list[tuple[str, nn.Module]], device: torch.device,
                kwargs: dict, lazy_rank: bool):
    """FullyShardedDataParallel over `model`, each unit its own FSDP unit (by identity). On CPU
    torch 2.9's FSDP1 rejects sync_module_states (it broadcasts over the GPU): the same broadcast
    from rank 0 happens here, before wrapping. `lazy_rank`: this rank built the model on the meta
    device (cpu_ram_efficient_loading), to be filled from rank 0."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    kwargs = dict(kwargs)
    if device.type == "cpu" and kwargs["sync_module_states"]:
        kwargs["sync_module_states"] = False
        if lazy_rank:
            model.to_empty(device=device)
        broadcast_from_rank0(chain(model.parameters(), model.buffers()))
    elif lazy_rank or any(p.is_meta for p in model.parameters()):
        # memory for the shards, values filled afterwards (from rank 0, or by a dry run): torch's
        # default calls reset_parameters(), which Hugging Face's norms do not have
        kwargs["param_init_fn"] = lambda m: m.to_empty(device=device, recurse=False)
    check_kwargs(FSDP.__init__, kwargs)
    ids = {id(m) for _, m in units}
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in ids)
    return FSDP(model, auto_wrap_policy=policy, device_id=device, **kwargs)


def broadcast_from_rank0(tensors) -> None:
    for t in tensors:
        dist.broadcast(t.data, src=0)


def sync_from_rank0(model: nn.Module, device: torch.device) -> None:
    """fsdp.sync_module_states: every rank starts from rank 0's parameters and buffers."""
    model.to(device)
    broadcast_from_rank0(chain(model.parameters(), model.buffers()))


def full_state_of(model: nn.Module) -> tuple[dict, list]:
    """Rank 0's weights before sharding replaces them (cpu_ram_efficient_loading): copies, because
    fully_shard and to_empty replace the originals; the buffers apart, as non-persistent ones are
    not in the state dict."""
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            [b.detach().clone() for b in model.buffers()])


def fill_from_rank0(model: nn.Module, full: tuple[dict, list] | None, device: torch.device,
                    partial: bool = False) -> None:
    """After sharding a model the ranks but 0 built on the meta device: rank 0's `full` weights
    (full_state_of; None on the other ranks) broadcast into every rank's shards. `partial`: each
    rank keeps part of them (topology.ep: its own experts; torch's strict load refuses the rest on
    rank 0), so that every name a rank holds is among rank 0's is checked here instead."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full_sd, buffers = full if full is not None else ({}, None)
    model.to_empty(device=device)
    if partial:
        names = [sorted(full_sd) if full is not None else None]
        dist.broadcast_object_list(names, src=0)
        missing = sorted(set(model.state_dict()) - set(names[0]))
        if missing:
            raise ValueError(f"fsdp.cpu_ram_efficient_loading: rank {dist.get_rank()} holds "
                             f"{missing[:3]}, which rank 0's model has not; the factory must "
                             "build the same model on every rank")
    set_model_state_dict(model, full_sd, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=not partial))
    for i, b in enumerate(model.buffers()):
        if buffers is not None:
            b.copy_(buffers[i])
        dist.broadcast(b, src=0)


def flat_members(model) -> Sharded:
    """Each parameter FSDP1 trains, with the original names it holds: one per parameter with
    use_orig_params, every member of its unit for a FlatParameter (its `_fqns`, relative to the
    module that owns it)."""
    out = []
    for name, p in model.named_parameters():
        fqns, name = getattr(p, "_fqns", None), clean_name(name)
        prefix = name.rpartition("_flat_param")[0]
        out.append((p, [prefix + f for f in fqns] if fqns is not None else [name]))
    return out


def check_kwargs(fn, kwargs: dict) -> None:
    accepted = set(inspect.signature(fn).parameters)
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise SpecError([(f"fsdp.native.{k}", f"is not an argument of {fn.__qualname__}; accepted: "
                          f"{', '.join(sorted(accepted - {'self', 'module'}))}") for k in unknown])
