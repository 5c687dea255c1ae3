"""torch FSDP engines: FSDP2 (`fully_shard`, default) and FSDP1 (`FullyShardedDataParallel`), built from
translate.py's plain arguments. On CPU the process group is gloo and FSDP1 gets device_id=cpu."""

from __future__ import annotations

import functools
from contextlib import contextmanager
import inspect
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from backends.fsdp.layout import edge_units
from backends.fsdp.tp import apply_tp
from parallel.engine.tp_plan import resolve_plan
from backends.fsdp.translate import translate
from parallel.checkpoint.sink import Sink
from parallel.checkpoint.dcp_state import read_model_optim, write_model_optim
from parallel.engine.base import Engine
from parallel.engine.step import OptimizerArg, clip_grad_norm, require_fp32
from parallel.engine.params import Sharded, clean_name
from parallel.engine.wrap import apply_ac, at_unit_places, plan_wrap
from parallel.spec.io import SpecError
from parallel.spec.model import Spec
from parallel.tools.measurable import ModuleStateTensors

DP = ("dp_replicate", "dp_shard")  # the mesh dims FSDP shards and replicates over (no tp)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # fp32 / None: no cast


def make_engine(spec: Spec) -> Engine:
    """`fsdp.version` picks the implementation; both share checkpoints, clipping and the loop."""
    return (FSDP2Engine if spec.fsdp.version == 2 else FSDP1Engine)(spec)


class _TorchFSDP(ModuleStateTensors, Engine):
    name = "fsdp"

    def __init__(self, spec: Spec):
        super().__init__(spec)
        self.plan = translate(spec)  # fail on a contradicting native key before any work
        self.units: list[tuple[str, nn.Module]] = []
        self.scaler = None
        if spec.precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            ls = spec.loss_scale
            self.scaler = ShardedGradScaler(self.device.type, init_scale=2.0**ls.initial_scale_power,
                                            growth_interval=ls.growth_interval)

    def _materialise(self, model) -> tuple[nn.Module, bool]:
        """Build the model; with cpu_ram_efficient_loading only rank 0 holds real weights."""
        lazy = self.spec.fsdp.cpu_ram_efficient_loading
        if isinstance(model, nn.Module):
            if lazy:
                raise SpecError([("fsdp.cpu_ram_efficient_loading", "needs a model factory: call "
                                  "prepare(lambda: Model(...)) so ranks other than 0 can build it "
                                  "on the meta device")])
        elif lazy and not self.is_main:
            with torch.device("meta"):
                model = model()
        else:
            model = model()
        require_fp32(model)
        self._record_params(model)  # names and groups as built, before sharding replaces them
        self.units = plan_wrap(model, self.spec.wrap)
        return model, lazy

    @property
    def forward_gathers(self) -> bool:  # NO_SHARD replicates: forwards are local
        return self.spec.shard != "none"

    def _sync_context(self, last: bool):
        return self._no_sync() if not last else super()._sync_context(last)

    def _grad_norm_and_clip(self) -> torch.Tensor:
        return clip_grad_norm(self.model.parameters(), self.spec.grad_clip)

    def _optimizer_step(self):
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip and report the true gradient
        norm = self._grad_norm_and_clip()
        stepped = True
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            stepped = self.scaler.get_scale() >= scale
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, stepped

    def _backward(self, share):
        (self.scaler.scale(share) if self.scaler is not None else share).backward()

    def _save_model_optim(self, sink: Sink) -> None:
        write_model_optim(sink, self.model, self.optimizer, self.spec.state_dict == "sharded",
                          self.rank, on_cpu=self.device.type == "cpu")

    def _load_model_optim(self, path: Path, manifest: dict) -> None:
        read_model_optim(path, self.model, self.optimizer)

    def native_checkpoint(self):
        """(save, load) as torchtitan's checkpointer does it: torch DCP of get_state_dict's model
        and optimizer state, no manifest, no digests (what `polyshard bench --save` compares with)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        def save(path: Path) -> None:
            msd, osd = get_state_dict(self.model, self.optimizer)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))

        def load(path: Path) -> None:
            msd, osd = get_state_dict(self.model, self.optimizer)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=str(path))
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])

        return save, load

    def gather_model(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        # Every rank gathers (no cpu_offload: FSDP1 segfaults with it on a CPU device, docs/fsdp.md)
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().cpu() for k, v in state.items()}


def broadcast_from_rank0(tensors) -> None:
    for t in tensors:
        dist.broadcast(t.data, src=0)


class FSDP2Engine(_TorchFSDP):
    def _prepare(self, model, optimizer: OptimizerArg):
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            fully_shard,
        )

        model, lazy = self._materialise(model)
        kwargs = dict(self.plan["kwargs"])
        if "mp_policy" in kwargs:
            mp = kwargs["mp_policy"]
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES.get(mp["param_dtype"]),
                                                       reduce_dtype=DTYPES.get(mp["reduce_dtype"],
                                                                               torch.float32))
        if isinstance(kwargs.get("offload_policy"), dict):
            # pinning needs a CUDA driver; on a CPU-only host there is nothing to pin
            pin = kwargs["offload_policy"]["pin_memory"] and self.device.type == "cuda"
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pin)
        _check_kwargs(fully_shard, kwargs)
        # the data-parallel slice of the engine's mesh: 2-D (replicas, shard group), or its shard dim
        mesh = self.device_mesh[DP if len(self.plan["mesh"]) == 2 else "dp_shard"]
        if lazy:
            full_sd, buffers = {}, None
            if self.is_main:  # copies: fully_shard and to_empty below replace the originals
                full_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
                buffers = [b.detach().clone() for b in model.buffers()]
        elif self.spec.fsdp.sync_module_states:
            model.to(self.device)
            broadcast_from_rank0(chain(model.parameters(), model.buffers()))
        # torchtitan's order: the tensor-parallel split first (fully_shard then shards its shards
        # again over the data-parallel dims), activation checkpointing, compile, fully_shard, each on
        # what sits at the unit's place (the checkpoint wrapper when there is one). fully_shard on
        # the wrapper keeps FSDP's hooks outside the recomputed region (a unit's parameters are
        # gathered once for backward and its recomputation) and outside the compiled graph (dynamo
        # skips FSDP's hooks: inside, they were a graph break before any code of the block, and the
        # block ran eagerly, measured in docs/compile.md). Compile on the wrapper compiles the
        # recomputation too. nn.Module.compile works in place and fully_shard keeps the object.
        if self.dims.tp > 1:
            apply_tp(model, self.device_mesh["tp"],
                     resolve_plan(model, self.dims.tp, self.spec.topology.tp_plan, self._say))
        if self.spec.checkpoint_activations:
            apply_ac(model, self.units)
        self.units = at_unit_places(model, self.units)
        if self.spec.compile.scope == "blocks":
            self._apply_compile(model, self.units)
        for _, unit in self.units:  # children first: each unit owns only what no inner unit owns
            fully_shard(unit, mesh=mesh, **kwargs)
        # the edges as torchtitan shards them (layout.py), then the root without an explicit
        # reshard_after_forward: torch keeps it unsharded, so nothing is gathered twice per step
        blocks_reshard = kwargs.pop("reshard_after_forward")
        for modules, like_blocks in edge_units(model, self.units):
            keep = blocks_reshard if like_blocks else self.spec.fsdp.reshard_output
            fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh,
                        reshard_after_forward=keep, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
        if self.spec.compile.scope == "model":
            self._apply_compile(model, [])
        if lazy:
            self._fill_from_rank0(model, full_sd, buffers)
        self._set_forward_prefetch(model)
        return model, self._optimizer_over(optimizer, model)

    def _fill_from_rank0(self, model, full_sd: dict, buffers) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        model.to_empty(device=self.device)
        set_model_state_dict(model, full_sd, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        for i, b in enumerate(model.buffers()):  # non-persistent buffers are not in state_dict
            if self.is_main:
                b.copy_(buffers[i])
            dist.broadcast(b, src=0)

    def _set_forward_prefetch(self, model: nn.Module) -> None:
        if not self.spec.fsdp.forward_prefetch:
            return
        # Forward runs units in module pre-order. plan_wrap lists them children first, which is
        # reversed pre-order for class policies but post-order for the size policy: sort, never
        # reverse (a reversed post-order made each unit prefetch the one that ran before it).
        position = {id(m): i for i, m in enumerate(model.modules())}
        forward_order = sorted((m for _, m in self.units), key=lambda m: position[id(m)])
        for this, nxt in zip(forward_order, forward_order[1:]):
            this.set_modules_to_forward_prefetch([nxt])

    def _no_sync(self):
        return _RequiresGradSync(self.model)


class _RequiresGradSync:
    """FSDP2's no_sync: keep unsharded gradients locally until the last micro-batch."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)


class FSDP1Engine(_TorchFSDP):
    @property
    def per_parameter_grads(self) -> bool:  # use_orig_params: the optimizer steps the originals
        return self.spec.fsdp.use_orig_params

    def _prepare(self, model, optimizer: OptimizerArg):
        from torch.distributed.fsdp import (
            BackwardPrefetch,
            CPUOffload,
            MixedPrecision,
            ShardingStrategy,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        model, lazy = self._materialise(model)
        kwargs = dict(self.plan["kwargs"])
        kwargs["sharding_strategy"] = ShardingStrategy[kwargs["sharding_strategy"]]
        if kwargs["backward_prefetch"]:
            kwargs["backward_prefetch"] = BackwardPrefetch[kwargs["backward_prefetch"]]
        # torch 2.9's FSDP1 pins offloaded shards, which needs a CUDA driver; on a CPU device the
        # parameters already live in CPU memory, which is what `offload: params` asks for.
        on_cpu = self.device.type == "cpu"
        kwargs["cpu_offload"] = CPUOffload(offload_params=kwargs["cpu_offload"] and not on_cpu)
        if "mixed_precision" in kwargs:
            mp = kwargs["mixed_precision"]
            kwargs["mixed_precision"] = MixedPrecision(
                param_dtype=DTYPES.get(mp["param_dtype"]),
                reduce_dtype=DTYPES.get(mp["reduce_dtype"], torch.float32))
        if self.plan["mesh"]:  # hybrid: the engine's (replicas, shard group) mesh
            kwargs["device_mesh"] = self.device_mesh[DP]
        if self.device.type == "cpu" and kwargs["sync_module_states"]:
            # torch 2.9's FSDP1 rejects sync_module_states for CPU tensors (it broadcasts over the
            # GPU); on CPU the same broadcast from rank 0 happens here, before wrapping.
            kwargs["sync_module_states"] = False
            if lazy and not self.is_main:
                model.to_empty(device=self.device)
            broadcast_from_rank0(chain(model.parameters(), model.buffers()))
        elif lazy and not self.is_main:
            kwargs["param_init_fn"] = lambda m: m.to_empty(device=self.device, recurse=False)
        _check_kwargs(FSDP.__init__, kwargs)
        ids = {id(m) for _, m in self.units}
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in ids)
        model = FSDP(model, auto_wrap_policy=policy, device_id=self.device, **kwargs)
        # FSDP1 wraps first and checkpoints the original modules inside their FSDP units afterwards
        # (torch's recipe): wrapping a CheckpointWrapper instead would hide the layer class.
        if self.spec.checkpoint_activations:
            apply_ac(model, self.units)
        # Compile last: each unit's block inside its FSDP wrapper (scope blocks), so FSDP1's
        # unshard/reshard runs outside the graphs and dynamo traces the original parameters
        # (use_orig_params), or the whole wrapped model (scope model).
        self._apply_compile(model, self.units)
        # use_orig_params: false leaves one flat parameter per unit, which holds several originals
        return model, self._optimizer_over(optimizer, model, flat_members(model))

    def _load_model_optim(self, path: Path, manifest: dict) -> None:
        super()._load_model_optim(path, manifest)
        repoint_offloaded(self.model)

    def _no_sync(self):
        return self.model.no_sync()

    @contextmanager
    def _unwrapped(self):
        # The root unit's own parameters (embeddings, final norm, head) are gathered for the block;
        # the inner units still gather theirs in each forward (recurse=False: never the whole model)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(self.model, writeback=False, recurse=False):
            yield self.model.module

    def _grad_norm_and_clip(self) -> torch.Tensor:
        # FSDP1's own clip reduces the norm over flat-parameter shards; inf means "report only".
        return self.model.clip_grad_norm_(self.spec.grad_clip or float("inf"))


def repoint_offloaded(model) -> None:
    """With offload_params on CUDA, torch's FSDP1 load leaves each flat parameter's data on a new CPU
    tensor holding the loaded values while its `_local_shard`, which FSDP reshards back to after the
    next forward and which the optimizer's parameters then view, keeps the values from before the
    load. Measured on an H100 (torch 2.11, one rank): the first step after a resume matched, the
    second did not (its update landed on the pre-load values; parameters off by 3.3e-2). The loaded
    values go into `_local_shard`, and the flat parameter and its views point at it again."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        if handle is None or not handle._offload_params:
            continue
        flat, shard = handle.flat_param, handle.flat_param._local_shard
        if flat.data_ptr() == shard.data_ptr() or flat.numel() != shard.numel():
            continue
        with torch.no_grad():
            shard.copy_(flat.data.view_as(shard))
        flat.data = shard
        if handle._use_orig_params:
            handle._use_sharded_views()


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


def _check_kwargs(fn, kwargs: dict) -> None:
    accepted = set(inspect.signature(fn).parameters)
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise SpecError([(f"fsdp.native.{k}", f"is not an argument of {fn.__qualname__}; accepted: "
                          f"{', '.join(sorted(accepted - {'self', 'module'}))}") for k in unknown])
