"""The engine's set-up: the process group and the parts the engine owns, then `prepare` (the backend's
model set-up between `_record_params` and `_optimizer_over`, with the model-parallel splits it calls:
`_apply_pipeline`, `_apply_expert_parallel`). engine.py builds the step on top of it; the data loaders
and the calls that hand to a part are calls.py; what a backend implements is hooks.py.

The parts, each one object made here and testable alone: `hang` (where this rank is, reported when a
collective times out), `checkpoints` (save / load / periodic saves / resume), `preemption` (a signal
becomes an agreed save and a requeue exit), `compile_watch` (compile.enabled: did it run compiled),
`nonfinite` (on_nonfinite: raise_deferred), `tracker` (tracking.to), `loaders` and `user_state`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch import nn

from parallel import dist as pdist
from parallel.engine.core.calls import EngineCalls
from parallel.kits.objective import CountFn, Objective
from parallel.engine.core.step import LossFn, OptimizerArg, build_optimizer, require_optimizer
from parallel.engine.data import packing
from parallel.engine.data.loaders import Loaders
from parallel.engine.model.compile import apply_compile
from parallel.engine.model.wrap import ForwardKwargs, forward_kwargs
from parallel.engine.model.pipeline.schedule import Pipeline
from parallel.engine.model.context_parallel import ContextParallel, apply_context_parallel
from parallel.engine.model.moe.expert_parallel import ExpertParallel, refuse_unsplit
from parallel.engine.model.moe.experts import Experts, router_blocks
from parallel.engine.model.moe.router import RouterLoss
from parallel.engine.model.float8 import Float8, apply_float8, batch_split
from parallel.engine.model.params import ParamGroupsHook, ParamPlan, per_parameter
from parallel.engine.model.tiled_loss import TiledLoss, apply_tiled_loss
from parallel.engine.observe.flops import model_flops
from parallel.engine.model.optim.muon import adopt_muon
from parallel.engine.model.optim.several import as_one, build_scheduler
from parallel.engine.observe.tracking import Tracker
from parallel.engine.state.checkpointing import Checkpointer
from parallel.engine.state.user_state import UserState
from parallel.engine.watch.compile import CompileStats, CompileWatch
from parallel.engine.watch.hang import HangWatch
from parallel.engine.watch.nonfinite import NonfiniteWatch
from parallel.engine.watch.preempt import Preemption
from parallel.spec.errors import SpecError
from parallel.spec.model import Spec


class EngineSetup(EngineCalls):
    def __init__(self, spec: Spec, packages: tuple[str, ...] = ()):
        """`packages`: distributions whose versions this engine's checkpoints record beside torch's
        (the backend's descriptor's; the registry passes them)."""
        self.spec = spec
        self._launch_env = pdist.launch_env()  # restored at close (a library may add to it)
        self.ctx = pdist.init_distributed(spec.timeout_s, spec.topology.device)
        self.hang = HangWatch(self.ctx.rank, spec.timeout_s, spec.checkpoint.dir)  # never per step
        self.progress = self.hang.progress
        self.dims = spec.dims  # every parallel dimension, built once
        self._check_world()
        pdist.seed_everything(spec.seed)
        self.step = 0
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.loss_fn: LossFn | None = None
        self._count_fn: CountFn | None = None
        self.objective = Objective(None, self.dims.dp_cp)  # set from the model in _record_params
        self.experts: Experts | None = None  # mixture-of-experts blocks, from _record_params
        self._expert_use: list[float] | None = None  # their use this step, summed over ranks
        self._step_metrics = None  # this step's metrics for the trackers (StepResult.metrics)
        self.router: RouterLoss | None = None  # their load-balancing loss, global (router.py)
        self.forward_kwargs, self.confines_flattened = ForwardKwargs({}, {}), True  # (below; packing.py)
        self.tiled: TiledLoss | None = None  # sequence.loss_tile's patched lm_head, likewise
        self.attention: str | None = None  # the HF model's attention implementation, likewise
        self.context: ContextParallel | None = None  # topology.cp's split and attention, likewise
        self.pipeline: Pipeline | None = None  # topology.pp's stages and schedule (_apply_pipeline)
        self.expert_parallel: ExpertParallel | None = None  # topology.ep (_apply_expert_parallel)
        self.float8: Float8 | None = None  # precision: fp8's converted layers (_record_params)
        self.notices: list[str] = []  # what this run does differently from one process, said once
        self.loaders = Loaders()  # training loaders by name (checkpointed), eval loaders apart
        self.user_state = UserState()  # the user's objects saved with each checkpoint
        # Called with the engine once a step's gradients exist, before the update (bench measures
        # gradient memory here): an extension point, empty by default.
        self.on_gradients: list[Callable[[EngineSetup], None]] = []
        self._batch_signature: dict | None = None  # the first batch's keys/dtypes, later held to
        self._param_groups_hook: ParamGroupsHook | None = None
        self.params: ParamPlan | None = None  # set by the backend before sharding
        # the checkpointer's port: the engine's public facts, and the two backend hooks that write
        # and read the model and optimizer, handed over (it calls nothing private)
        self.checkpoints = Checkpointer(self, self._save_model_optim, self._load_model_optim,
                                        self.progress, packages)
        self.preemption = Preemption(spec, self.is_main)
        self.compile_watch: CompileWatch | None = None  # compile.enabled, from _apply_compile
        self.nonfinite: NonfiniteWatch | None = None  # on_nonfinite: raise_deferred, from prepare()
        self.tracker = Tracker(spec, self.is_main, self.device)  # tracking.to; idle when empty
        self._model_facts: dict = {}  # the model as built (parameter counts, FLOPs per token)

    # ---- facts ----
    rank = property(lambda self: self.ctx.rank)
    world_size = property(lambda self: self.ctx.world_size)
    device = property(lambda self: self.ctx.device)
    is_main = property(lambda self: self.ctx.is_main)

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @functools.cached_property
    def device_mesh(self):
        """The torch DeviceMesh over every dimension (ParallelDims.mesh_dims), made on first use
        (backends that shard with torch's DeviceMesh take the slice they shard over)."""
        return self.dims.device_mesh(self.device.type)

    @functools.cached_property
    def groups(self) -> pdist.Groups:
        """The process groups the engine's reductions name (parallel/dist.py): the step's target
        count over the data-parallel ranks (a tensor-parallel group's ranks hold the same
        micro-batch: counting over them too would count it tp times), the loss over the world."""
        return pdist.Groups(dp=self._data_parallel_group())

    def say(self, message: str) -> None:
        """Where this backend means something other than one process would: kept in `notices`
        (every rank) and printed once (the main rank)."""
        self.notices.append(message)
        if self.is_main:
            print(f"polyshard: {message}", file=sys.stderr, flush=True)

    def _check_world(self) -> None:
        if self.ctx.world_size != self.spec.world_size:
            raise RuntimeError(
                f"topology: the spec describes {self.spec.world_size} ranks (nodes "
                f"{self.spec.topology.nodes} x procs_per_node {self.spec.topology.procs_per_node}) "
                f"but {self.ctx.world_size} processes were launched; launch with "
                f"`polyshard launch` (it reads the topology) or fix topology.procs_per_node")

    # ---- set-up ----
    def prepare(self, model: nn.Module | Callable[[], nn.Module], optimizer: OptimizerArg = None,
                scheduler: Callable | None = None, loss_fn: LossFn | None = None,
                param_groups: ParamGroupsHook | None = None,
                count_fn: CountFn | None = None) -> nn.Module:
        """Shard `model` (a module, or a factory for memory-efficient loading), then build the
        optimizer over the sharded parameters and the scheduler over the optimizer.

        `optimizer`: (class, kwargs), or a callable taking what to optimize. Param groups built from
        the model before prepare (the usual habit) are mapped onto the sharded parameters by name.
        `param_groups`: called once before sharding with the model's (name, parameter) pairs as
        built (full shapes, on every backend), it returns torch-style groups whose "params" are
        names or parameters; the optimizer is built over those groups of sharded parameters.
        `count_fn(micro_batch)`: how many items `loss_fn`'s mean is taken over (a tensor or int), so
        that micro-batches weigh by it (`loss_weighting: tokens`); Hugging Face models with `labels`
        need none (parallel/kits/objective.py)."""
        require_optimizer(optimizer)  # a frozen model's place is #84's (step.py)
        self.loss_fn, self._count_fn, self._param_groups_hook = loss_fn, count_fn, param_groups
        self._check_global_batch()
        self.model, self.optimizer = self._prepare(model, optimizer)
        self.scheduler = build_scheduler(scheduler, self._scheduled_optimizer()) if scheduler \
            else None
        if self.spec.on_nonfinite == "raise_deferred":
            self.nonfinite = self._nonfinite_watch()
        self.preemption.install(self._agreed_flag())
        self.tracker.start(self.spec, self._model_facts.get("flops"),
                           self.world_size * self.devices_per_process,
                           {k: v for k, v in self._model_facts.items() if k != "flops"})
        return self.model

    @property
    def model_parts(self) -> list[nn.Module]:
        """The modules a step runs: this rank's pipeline stages, else the model alone."""
        return self.pipeline.parts if self.pipeline is not None else [self.model]

    def _apply_pipeline(self, model: nn.Module, runner: type[Pipeline] = Pipeline) -> nn.Module:
        """topology.pp (backends call it after `_record_params`, before sharding): this rank's
        stages of `model` (`model_parts`); returns one module over them under the model's names.
        `runner`: what runs the stages' schedule (torch's, or a backend's own Pipeline)."""
        from parallel.engine.model.pipeline.apply import apply_pipeline, check_pipelined
        from parallel.engine.model.pipeline.schedule import MULTI

        schedule = self.spec.pipeline.schedule
        check_pipelined(model, self.params.tied, self.objective, self.loss_fn is not None,
                        self.router, self.spec.pipeline.split_points, self.say,
                        schedule if self.experts and self.dims.dp_cp > 1 and schedule in MULTI
                        else None)
        view, self.pipeline = apply_pipeline(model, self.spec, self.dims.pp_rank(self.rank),
                                             self.device_mesh["pp"].get_group(), self.device,
                                             self.forward_kwargs.every(), runner)
        self.params.restrict({n for _, names in per_parameter(view) for n in names})
        return view

    def _apply_expert_parallel(self, model: nn.Module) -> ExpertParallel:
        """topology.ep (backends call it after `_record_params` and any pipeline split, before
        sharding): each block keeps its ep rank's experts (expert_parallel.py)."""
        if not self.experts:
            refuse_unsplit(model, self.dims.ep)
        self.expert_parallel = ExpertParallel(model, self.experts.blocks, self.dims,
                                              self.device.type)
        self.params.restrict({n for _, names in per_parameter(model) for n in names})
        return self.expert_parallel

    @property
    def splits(self) -> tuple:
        """The parts that leave each rank part of the model: ep's experts, pipeline stages."""
        return tuple(p for p in (self.expert_parallel, self.pipeline) if p is not None)

    def _apply_compile(self, model: nn.Module, units: list[tuple[str, nn.Module]],
                       compile_model: Callable | None = None) -> None:
        """Backends call this from `_prepare` where their order needs it (model/compile.py)."""
        self.compile_watch = apply_compile(model, units, self.spec.compile, self.spec.wrap.policy,
                                           self.is_main, compile_model)

    def _check_global_batch(self) -> None:
        """global_batch_size against what this launch feeds (SPMD's devices are known only now)."""
        wanted, fed = self.spec.global_batch_size, self.samples_per_step * self.dp_size
        if wanted is not None and wanted != fed:
            raise SpecError([("global_batch_size", f"{wanted}, but this launch feeds {fed} samples "
                              f"per step ({self.samples_per_step} per process x {self.dp_size} "
                              "data-parallel process(es)); change micro_batch_size, "
                              "grad_accum_steps or the topology")])

    def _record_params(self, model: nn.Module) -> ParamPlan:
        """Before sharding: parameter names, tied weights, the param_groups hook's groups, and what
        the model's loss averages over."""
        if self.spec.precision == "fp8":  # first: every later step sees the converted layers
            self.float8 = apply_float8(model, self.spec.float8, self.device, self.say,
                                       batch_split(self.dims, self.spec.grad_accum_steps))
        # gradients are averaged over every rank holding other tokens: data parallel x cp
        self.objective = Objective.for_model(model, self._count_fn, self.loss_fn is not None,
                                             self.spec.loss_weighting, self.dims.dp_cp)
        # under ep the dispatch runs every held expert itself (expert_parallel.py)
        self.experts = Experts(model, touch=self.dims.dp_cp > 1 and self.dims.ep == 1) or None
        self.router = RouterLoss.for_model(model, router_blocks(model), self.spec.moe.router_loss,
                                           self.dims.dp_cp, self.loss_fn is not None)
        self.forward_kwargs = forward_kwargs(model, self.router is not None)
        self.confines_flattened = packing.confines_flattened(model)
        self.tiled = apply_tiled_loss(model, self.spec.sequence.loss_tile, self.loss_fn is not None)
        self.attention = packing.attention_of(model)  # how packed rows confine attention
        # after attention_of: packed rows' masks are the model's own implementation's
        self.context = apply_context_parallel(model, self.dims.cp, self.dims.cp_rank(self.rank),
                                              self.dims.tp, self.say)
        if self.context is not None:
            self.context.group = self._context_group()
        if self.tracker.active:  # logged as hyper-parameters; FLOPs per token for MFU
            self._model_facts = {"flops": model_flops(model), "model.class": type(model).__name__,
                                 "model.params": sum(p.numel() for p in model.parameters()),
                                 "model.trainable_params": sum(p.numel() for p in model.parameters()
                                                               if p.requires_grad)}
        if self.experts and not self.per_parameter_grads:
            self.say(f"{self.name} ({type(self).__name__}) steps flat tensors, so an expert no rank "
                     f"routes a token to in a step gets a zero gradient and is still updated "
                     f"(weight decay, momentum, Adam's step count), where one process skips it: "
                     f"{self.experts.summary()}. FSDP2, FSDP1 with use_orig_params and XLA FSDP v2 "
                     "skip it exactly (docs/moe.md)")
        # stand-ins on the GPU, so that a factory asking for a fused optimizer sees CUDA tensors
        where = self.device if self.device.type == "cuda" else "cpu"
        self.params = ParamPlan(model, self._param_groups_hook, where)
        return self.params

    def _optimizer_over(self, optimizer: OptimizerArg, model: nn.Module,
                        sharded=None) -> torch.optim.Optimizer:
        """After sharding: the optimizer over `model`'s (sharded) parameters, groups mapped by name,
        holding every trainable parameter exactly once (else OptimizerMismatch). `sharded`: each
        trained tensor with the original names it holds, where that is not one per parameter.
        A factory may return several optimizers (a list): they become one (optim/several.py).
        Each torch.optim.Muon among them orthogonalizes whole matrices (optim/muon.py)."""
        sharded = sharded or per_parameter(model)
        built = as_one(self.params.optimizer(lambda groups: build_optimizer(optimizer, groups),
                                             sharded))
        shapes = {n: tuple(s.shape) for n, s in self.params.as_built}
        adopt_muon(built, sharded, shapes, functools.partial(self._matrix_layout, model))
        return built

    @property
    def samples_per_step(self) -> int:
        """Samples this process feeds per optimizer step."""
        return self.spec.micro_batch_size * self.spec.grad_accum_steps * self.devices_per_process

    # ---- what a checkpoint holds of the trainer (the checkpointer's port) ----
    def trainer_state(self) -> dict:
        return {"step": self.step,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "loaders": self.loaders.state_dict()}

    def load_trainer_state(self, state: dict) -> None:
        self.step = state["step"]
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.loaders.load_state_dict(state["loaders"], self.say)
        if self.nonfinite is not None:
            self.nonfinite.at(self.step)
        self.preemption.at(self.step)

    def compile_stats(self) -> CompileStats | None:
        """What torch.compile did in this process (None without compile.enabled)."""
        return None if self.compile_watch is None else self.compile_watch.stats()

