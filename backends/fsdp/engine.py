"""torch FSDP engines: FSDP2 (`fully_shard`, default) and FSDP1 (`FullyShardedDataParallel`), built from
translate.py's plain arguments. On CPU the process group is gloo and FSDP1 gets device_id=cpu."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from backends.fsdp import flat_state
from backends.fsdp.parallelize import (
    apply_expert_fsdp,
    apply_forward_prefetch,
    apply_fsdp1,
    apply_fsdp2,
    apply_tp,
    fill_from_rank0,
    flat_members,
    fsdp1_kwargs,
    fsdp2_kwargs,
    full_state_of,
    shard_mesh,
    sync_from_rank0,
)
from backends.fsdp.translate import translate
from parallel.checkpoint.state.dcp_state import LiveState, read_model_optim, write_model_optim
from parallel.checkpoint.state.sink import Sink
from parallel.engine.core.engine import Engine
from parallel.engine.core.step import OptimizerArg, check_built, clip_grad_norm
from parallel.engine.model.tp_plan import held_part, resolve_plan
from parallel.engine.model.wrap import apply_ac, at_unit_places, plan_wrap
from parallel.engine.model.optim.several import members
from parallel.spec.errors import SpecError
from parallel.spec.model import Spec
from parallel.kits.measurable import ModuleStateTensors

DP = ("dp_replicate", "dp_shard")  # the mesh dims FSDP1 shards and replicates over (no tp)


def make_engine(spec: Spec, **context) -> Engine:
    """`fsdp.version` picks the implementation; both share checkpoints, clipping and the loop."""
    return (FSDP2Engine if spec.fsdp.version == 2 else FSDP1Engine)(spec, **context)


class _TorchFSDP(ModuleStateTensors, Engine):
    name = "fsdp"

    def __init__(self, spec: Spec, **context):
        super().__init__(spec, **context)
        self.plan = translate(spec)  # fail on a contradicting native key before any work
        self.units: list[tuple[str, nn.Module]] = []
        self.live = LiveState()  # the sharded state get_state_dict gave, while it is still live
        self.scaler = None
        if spec.precision == "fp16":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            ls = spec.loss_scale
            self.scaler = ShardedGradScaler(self.device.type, init_scale=2.0**ls.initial_scale_power,
                                            growth_interval=ls.growth_interval)

    def _materialise(self, model, sync: bool = False) -> tuple[nn.Module, bool]:
        """Build the model; with cpu_ram_efficient_loading only rank 0 holds real weights. `sync`:
        every rank takes rank 0's, before _record_params (precision: fp8's float8 all-gather
        weights, tensor subclasses, can no longer be moved to the device once recorded)."""
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
        check_built(model)
        if sync and not lazy:  # the whole model, before any split
            sync_from_rank0(model, self.device)
        self._record_params(model)  # names and groups as built, before sharding replaces them
        self.units = plan_wrap(model, self.spec.wrap)
        return model, lazy

    @property
    def forward_gathers(self) -> bool:  # NO_SHARD replicates: forwards are local
        return self.spec.shard != "none"

    def _sync_context(self, last: bool):
        return self._no_sync() if not last else super()._sync_context(last)

    def _grad_norm_and_clip(self) -> torch.Tensor:
        stages = self.pipeline.layout.group if self.pipeline is not None else None
        return clip_grad_norm(self.model.parameters(), self.spec.grad_clip, stages,
                              self.expert_parallel)

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
                          self.rank, on_cpu=self.device.type == "cpu", live=self.live,
                          splits=self.splits)

    def _load_model_optim(self, path: Path, manifest: dict, weights_only: bool = False) -> None:
        self.live.clear()  # it holds the state tensors the load replaces
        read_model_optim(path, self.model, self.optimizer, weights_only, self.splits)

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
        state = {k: v.detach().cpu() for k, v in state.items()}
        return state if self.expert_parallel is None else self.expert_parallel.gather_whole(state)


class FSDP2Engine(_TorchFSDP):
    def _prepare(self, model, optimizer: OptimizerArg):
        model, lazy = self._materialise(model, sync=self.spec.fsdp.sync_module_states)
        # the tensor-parallel plan is checked against the whole model, each stage takes its part
        plan = resolve_plan(model, self.dims.tp, self.spec.topology.tp_plan, self.say) \
            if self.dims.tp > 1 else None
        # rank 0's weights before ep drops the experts other ranks hold (pp refuses lazy loading)
        full = full_state_of(model) if lazy and self.is_main else None
        if self.dims.pp > 1:  # this rank's pipeline stages, each sharded as a model of its own
            model = self._apply_pipeline(model)
        if self.dims.ep > 1:  # this rank's experts (each sharded as a unit of its own below)
            self._apply_expert_parallel(model)
        units = [self._shard_fsdp2(part, lazy, plan, full)
                 for part in (self.pipeline.parts if self.pipeline is not None else [model])]
        self.units = [u for each in units for u in each]
        return model, self._optimizer_over(optimizer, model)

    def _shard_fsdp2(self, model: nn.Module, lazy: bool, plan, full) -> list[tuple[str, nn.Module]]:
        """One model (or pipeline stage) split, checkpointed, compiled and sharded; its units.
        `full`: rank 0's whole weights (cpu_ram_efficient_loading), None elsewhere."""
        kwargs = fsdp2_kwargs(self.plan["kwargs"], self.device.type)
        mesh = shard_mesh(self.device_mesh, hybrid=len(self.plan["mesh"]) == 2, cp=self.dims.cp)
        units = plan_wrap(model, self.spec.wrap) if self.pipeline is not None else self.units
        # torchtitan's order: the tensor-parallel split first (fully_shard then shards its shards
        # again over the data-parallel dims), activation checkpointing, compile, fully_shard, each on
        # what sits at the unit's place (the checkpoint wrapper when there is one). fully_shard on
        # the wrapper keeps FSDP's hooks outside the recomputed region (a unit's parameters are
        # gathered once for backward and its recomputation) and outside the compiled graph (dynamo
        # skips FSDP's hooks: inside, they were a graph break before any code of the block, and the
        # block ran eagerly, measured in docs/compile.md). Compile on the wrapper compiles the
        # recomputation too. nn.Module.compile works in place and fully_shard keeps the object.
        if plan is not None:
            apply_tp(model, self.device_mesh["tp"], held_part(model, plan))
        if self.spec.checkpoint_activations:
            apply_ac(model, units)
        units = at_unit_places(model, units)
        if self.expert_parallel is not None:  # the experts' units first: the blocks' leave them
            ep = self.expert_parallel
            apply_expert_fsdp(ep.units(model), ep.shard_mesh, kwargs, ep.divide_by, self.device.type)
        if self.spec.compile.scope == "blocks":
            self._apply_compile(model, units)
        apply_fsdp2(model, units, mesh, kwargs, self.spec.fsdp.reshard_output)
        if self.spec.compile.scope == "model":
            self._apply_compile(model, [])
        if lazy:
            fill_from_rank0(model, full, self.device, partial=self.dims.ep > 1)
        if self.spec.fsdp.forward_prefetch:
            apply_forward_prefetch(model, units)
        return units

    def _optimizer_step(self):
        out = super()._optimizer_step()
        if self.float8 is not None:  # float8.all_gather: the next gather's scales, whole weights
            self.float8.refresh(self.model_parts)
        return out

    def _load_model_optim(self, path: Path, manifest: dict, weights_only: bool = False) -> None:
        super()._load_model_optim(path, manifest, weights_only)
        if self.float8 is not None:  # the scales of the weights before the load are stale
            self.float8.refresh(self.model_parts)

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
    def __init__(self, spec: Spec, **context):
        super().__init__(spec, **context)
        self.flat_live = flat_state.LiveFlat()  # sharded saves' views, kept while they are live

    @property
    def per_parameter_grads(self) -> bool:  # use_orig_params: the optimizer steps the originals
        return self.spec.fsdp.use_orig_params

    def _prepare(self, model, optimizer: OptimizerArg):
        model, lazy = self._materialise(model)
        # hybrid: the engine's (replicas, shard group) mesh
        mesh = self.device_mesh[DP] if self.plan["mesh"] else None
        kwargs = fsdp1_kwargs(self.plan["kwargs"], self.device, mesh)
        model = apply_fsdp1(model, self.units, self.device, kwargs, lazy and not self.is_main)
        # FSDP1 wraps first and checkpoints the original modules inside their FSDP units afterwards
        # (torch's recipe): wrapping a CheckpointWrapper instead would hide the layer class.
        if self.spec.checkpoint_activations:
            apply_ac(model, self.units)
        # Compile last: each unit's block inside its FSDP wrapper (scope blocks), so FSDP1's
        # unshard/reshard runs outside the graphs and dynamo traces the original parameters
        # (use_orig_params), or the whole wrapped model (scope model).
        self._apply_compile(model, self.units)
        # use_orig_params: false leaves one flat parameter per unit, which holds several originals
        built = self._optimizer_over(optimizer, model, flat_members(model))
        kinds = {type(m).__name__ for m in members(built)}
        if self.spec.state_dict == "full" and len(kinds) > 1:
            raise SpecError([("state_dict", f"full with several optimizers ({sorted(kinds)}) on "
                              "FSDP1: torch 2.9's FSDP1 gathers a unit's optimizer state name by "
                              "name over all its parameters and fails where they carry different "
                              "state (measured: 'Manually calculated _sharded_numel_padded is "
                              "incorrect'); use state_dict: sharded (the default) or FSDP2")])
        return model, built

    def _matrix_layout(self, model, p, name: str, shape: tuple):
        from backends.fsdp.muon import flat_layouts, layout_of

        if not hasattr(self, "_flat_layouts"):  # every unit's, once (the optimizer's build)
            self._flat_layouts = flat_layouts(model)
        return layout_of(self._flat_layouts, p, name, shape)

    # Sharded checkpoints: each rank writes and reads its flat shards' ranges in place
    # (flat_state.py), not through torch's get_state_dict / set_state_dict (measured there).
    def _save_model_optim(self, sink: Sink) -> None:
        if self.spec.state_dict != "sharded":
            return super()._save_model_optim(sink)
        flat_state.save(sink, self.model, self.optimizer, self.params.tied, self.is_main,
                        self.flat_live)

    def _load_model_optim(self, path: Path, manifest: dict, weights_only: bool = False) -> None:
        self.flat_live.clear()
        if self.spec.state_dict == "sharded":
            return flat_state.load(path, self.model, self.optimizer, self.params.tied, weights_only)
        super()._load_model_optim(path, manifest, weights_only)
        repoint_offloaded(self.model)

    def _no_sync(self):
        return self.model.no_sync()

    @contextmanager
    def _unwrapped(self):
        # The root unit's own parameters (embeddings, final norm, head) are gathered for the block;
        # the inner units still gather theirs in each forward (recurse=False: never the whole model).
        # Under mixed precision the gathered root parameters are fp32 while each inner unit computes
        # in 16 bits, and only the root's forward (bypassed here) casts inputs: autocast in the
        # training dtype joins them (measured before: generate after bf16 training raised "expected
        # m1 and m2 to have the same dtype" in the first q_proj).
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(self.model, writeback=False, recurse=False), \
                self._unwrapped_autocast():
            yield self.model.module

    def _unwrapped_autocast(self):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.spec.compute)
        if dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

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
