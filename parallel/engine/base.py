"""The interface every backend implements, and the training loop they share.

`train_step` is a template: split the step's batch into micro-batches, forward/backward each, reduce
the loss, then one optimizer step. Backends fill in only what differs, through the hooks listed on
`Engine`, so the loop reads top to bottom in one place. What is not the step is a part the engine
owns and calls at a named point: `hang` (where this rank is, reported when a collective times out),
`checkpoints` (save / load / periodic saves / resume), `preemption` (a signal becomes an agreed save
and a requeue exit), `compile_watch` (compile.enabled: did it run compiled) and `nonfinite`
(on_nonfinite: raise_deferred). Each is one object, testable alone.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from parallel.engine import dist as pdist
from parallel.engine.loaders import Loaders, build_loader, plain_batch
from parallel.engine.calls import EngineCalls
from parallel.engine.checkpointing import Checkpointer
from parallel.engine.compiling import CompileStats, CompileWatch, apply_compile
from parallel.engine.guards import (
    BatchError,
    NonFiniteLossError,
    NonfiniteWatch,
    batch_problem,
    nonfinite_ranks,
)
from parallel.engine.hang import CollectiveTimeout, HangWatch, is_timeout, timeout_error
from parallel.engine.preempt import Preemption
from parallel.engine.flops import model_flops
from parallel.engine.tracking import Tracker
from parallel.engine.user_state import UserState
from parallel.engine.experts import Experts
from parallel.engine.objective import CountFn, Objective
from parallel.engine.params import ParamGroupsHook, ParamPlan, per_parameter
from parallel.engine.step import (
    LossFn,
    OptimizerArg,
    StepResult,
    build_optimizer,
    batch_width,
    count_tokens,
)
from parallel.spec.model import Spec


class Engine(EngineCalls):
    """prepare -> train_step / eval_step -> save / load -> close. Backends implement the hooks of
    `BackendHooks` (hooks.py) and nothing else; the calls that hand straight to one of the engine's
    parts are in calls.py."""

    def __init__(self, spec: Spec):
        self.spec = spec
        self.ctx = pdist.init_distributed(spec.timeout_s)
        self.hang = HangWatch(self.ctx.rank)  # idle until a collective times out; never per step
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
        self.objective = Objective(None, self.dp_size)  # set from the model in _record_params
        self.experts: Experts | None = None  # mixture-of-experts blocks, from _record_params
        self.notices: list[str] = []  # what this run does differently from one process, said once
        self.loaders = Loaders()  # training loaders by name (checkpointed), eval loaders apart
        self.user_state = UserState()  # the user's objects saved with each checkpoint
        # Called with the engine once a step's gradients exist, before the update (bench measures
        # gradient memory here): an extension point, empty by default.
        self.on_gradients: list[Callable[[Engine], None]] = []
        self._batch_signature: dict | None = None  # the first batch's keys/dtypes, later held to
        self._param_groups_hook: ParamGroupsHook | None = None
        self.params: ParamPlan | None = None  # set by the backend before sharding
        self.checkpoints = Checkpointer(self, self.progress)
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
        """The torch DeviceMesh over (dp_replicate, dp_shard, tp), made on first use (backends that
        shard with torch's DeviceMesh take the slice they shard over)."""
        return self.dims.device_mesh(self.device.type)

    @functools.cached_property
    def count_group(self):
        """Where the step's target count is summed: the data-parallel processes (None: all). A
        tensor-parallel group's ranks hold the same micro-batch; summing over them too would
        count it tp times (and pay a collective over the TP group where dp is 1)."""
        return None if self.dims.tp == 1 else pdist.data_parallel_group(self.device_mesh)

    def _say(self, message: str) -> None:
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
    def prepare(self, model: nn.Module | Callable[[], nn.Module], optimizer: OptimizerArg,
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
        need none (parallel/engine/objective.py)."""
        self.loss_fn, self._count_fn = loss_fn, count_fn
        self._param_groups_hook = param_groups
        self._check_global_batch()
        self.model, self.optimizer = self._prepare(model, optimizer)
        self.scheduler = scheduler(self._scheduled_optimizer()) if scheduler else None
        if self.spec.on_nonfinite == "raise_deferred":
            self.nonfinite = self._nonfinite_watch()
        self.preemption.install(self._agreed_flag())
        self.tracker.start(self.spec, self._model_facts.get("flops"),
                           self.world_size * self.devices_per_process,
                           {k: v for k, v in self._model_facts.items() if k != "flops"})
        return self.model

    def _apply_compile(self, model: nn.Module, units: list[tuple[str, nn.Module]],
                       compile_model: Callable | None = None) -> None:
        """Backends call this from `_prepare` where their order needs it (compiling.py)."""
        self.compile_watch = apply_compile(model, units, self.spec.compile, self.spec.wrap.policy,
                                           self.is_main, compile_model)

    def _check_global_batch(self) -> None:
        """global_batch_size against what this launch feeds (SPMD's devices are known only now)."""
        wanted, fed = self.spec.global_batch_size, self.samples_per_step * self.dp_size
        if wanted is not None and wanted != fed:
            from parallel.spec.io import SpecError

            raise SpecError([("global_batch_size", f"{wanted}, but this launch feeds {fed} samples "
                              f"per step ({self.samples_per_step} per process x {self.world_size} "
                              "process(es)); change micro_batch_size, grad_accum_steps or the "
                              "topology")])

    def _record_params(self, model: nn.Module) -> ParamPlan:
        """Before sharding: parameter names, tied weights, the param_groups hook's groups, and what
        the model's loss averages over."""
        self.objective = Objective.for_model(model, self._count_fn, self.loss_fn is not None,
                                             self.spec.loss_weighting, self.dp_size)
        self.experts = Experts(model, touch=self.dp_size > 1) or None
        if self.tracker.active:  # logged as hyper-parameters; FLOPs per token for MFU
            self._model_facts = {"flops": model_flops(model), "model.class": type(model).__name__,
                                 "model.params": sum(p.numel() for p in model.parameters()),
                                 "model.trainable_params": sum(p.numel() for p in model.parameters()
                                                               if p.requires_grad)}
        if self.experts and not self.per_parameter_grads:
            self._say(f"{self.name} ({type(self).__name__}) steps flat tensors, so an expert no rank "
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
        trained tensor with the original names it holds, where that is not one per parameter."""
        return self.params.optimizer(lambda groups: build_optimizer(optimizer, groups),
                                     sharded or per_parameter(model))

    def dataloader(self, dataset, batch_size: int | None = None, shuffle: bool = True,
                   collate_fn=None, *, name: str | None = None, eval: bool = False,
                   drop_last: bool | None = None, accept_changed_data: bool = False,
                   **torch_kwargs):
        """This rank's loader of step batches (micro_batch_size * grad_accum_steps samples each) of
        a map-style or iterable dataset (Hugging Face `datasets`, streaming too), sharded by
        data-parallel rank. A training loader's position is saved with the checkpoint under `name`;
        `eval=True` loaders never are (loaders.py). `torch_kwargs`: num_workers, pin_memory,
        prefetch_factor, persistent_workers, as torch's DataLoader takes them."""
        if drop_last is False and not eval:
            raise ValueError("engine.dataloader: drop_last=False on a training loader: its last "
                             "batch would be short and the step takes a fixed number of samples "
                             "per rank (micro_batch_size x grad_accum_steps); keep drop_last, or "
                             "pass eval=True for an evaluation loader")
        loader = build_loader(dataset, size=batch_size or self.samples_per_step,
                              dp_size=self.dp_size, dp_rank=self.dp_rank, seed=self.spec.seed,
                              shuffle=shuffle, collate_fn=collate_fn,
                              drop_last=not eval if drop_last is None else drop_last,
                              device_loader=self._device_loader, eval_=eval, **torch_kwargs)
        return self.loaders.add(loader, name, eval, accept_changed_data)

    @property
    def samples_per_step(self) -> int:
        """Samples this process feeds per optimizer step."""
        return self.spec.micro_batch_size * self.spec.grad_accum_steps * self.devices_per_process

    # ---- the step ----
    def train_step(self, batch) -> StepResult:
        """One optimizer step on this rank's batch. A malformed batch raises BatchError on this
        rank before any collective (the launcher then ends the job); a collective that times out
        raises CollectiveTimeout naming the ranks that are elsewhere. Beyond the step's own work it
        pays one loss reduction and, with on_nonfinite raise|skip, one host read of it
        (docs/reliability.md, "What a step pays")."""
        start = time.perf_counter()
        self.preemption.check_start(self.device)  # first call: a signal during start-up exits
        if self.preemption.pending is not None:  # saved after the previous step: exit to requeue
            raise self.preemption.pending
        self.check_finite()  # raise_deferred: an earlier step's record, if it has landed
        self.progress.at(self.step + 1, "checking the batch")
        batch = plain_batch(batch)  # a BatchEncoding (HF collators) as the dict it holds
        problem, signature = batch_problem(batch, self._batch_signature, self.samples_per_step)
        if problem is not None:
            raise BatchError(f"step {self.step + 1}: rank {self.rank}: {problem}")
        self._batch_signature = self._batch_signature or signature
        with self._guard(f"step {self.step + 1}"):
            result = self._train_step(batch, start)
            # every rank alike: an agreed signal saves here, synchronously
            self.preemption.after_step(self.step, lambda path: self.save(path, async_save=False))
        if self.compile_watch is not None:  # compile.enabled: host-only checks that it ran compiled
            self.compile_watch.after_step(self.step)
        self.tracker.after_step(result, batch_width(batch))  # main rank, every tracking.every steps
        self.progress.at(self.step, "done")
        return result

    @contextmanager
    def _guard(self, what: str):
        """A collective that times out (or loses its peer) becomes a CollectiveTimeout naming the
        ranks that are elsewhere, and where (parallel/engine/hang.py)."""
        try:
            yield
        except RuntimeError as err:
            if isinstance(err, CollectiveTimeout) or not is_timeout(err):
                raise
            raise timeout_error(self.rank, self.world_size, what, self.spec.timeout_s,
                                self.progress, self.spec.checkpoint.dir or os.getcwd()) from err

    def _train_step(self, batch, start: float) -> StepResult:
        self.model.train()
        micro_batches = [self._to_device(m) for m in self._split(batch)]
        # Each micro-batch weighs by the items its loss averages over (objective.py), so the step's
        # loss and gradient are one process's on the global batch. The global count is one small
        # reduction, in flight during the first forward and waited for at the first backward.
        counts = self.objective.counts(micro_batches)
        total = pdist.PendingSum(counts.sum(), self.count_group) if counts is not None else None
        local = torch.zeros((), device=self.device)
        self.progress.phase = "forward/backward"
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with self._sync_context(last):  # skip gradient reduction until the last micro-batch
                share = self.objective.share(self._loss(micro), i, counts, total,
                                             len(micro_batches))
                self._backward(share)
            local += share.detach().float()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this update uses (schedule moves after)
        self.progress.phase = "optimizer step"
        if self.nonfinite is None:  # raise | skip: decided before the update
            # The mean over ranks is non-finite exactly when some rank's loss is: the reduction a
            # logging loop does anyway carries the decision, and one host read makes it.
            mean = self._reduce_loss(local)
            value = float(mean)
            grad_norm, stepped = (self._update() if math.isfinite(value)
                                  else self._nonfinite(local))
        else:  # raise_deferred: nothing waits for the loss; the record is checked later
            grad_norm, stepped = self._update()
            mean, value = self._reduce_loss(local), None
            self.nonfinite.record(mean, local)
        if self.scheduler is not None and stepped:
            self.scheduler.step()
        self.step += 1
        return StepResult(step=self.step, loss_tensor=mean, grad_norm_tensor=grad_norm, lr=lr,
                          tokens=count_tokens(batch) * self.dp_size,
                          targets_tensor=total() if total is not None else None,
                          step_time=time.perf_counter() - start, stepped=stepped,
                          loss_value=value)

    def _reduce_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The step's one reduction: the mean loss over ranks and, in the same tensor (no second
        collective), the fraction of ranks that caught a preemption signal (preempt.py)."""
        flag = self.preemption.flag(local.device)
        if flag is None:
            return pdist.all_mean(local)
        packed = pdist.all_mean(torch.stack([local.float(), flag]))
        self.preemption.record(self.step + 1, packed[1])
        return packed[0]

    def _update(self) -> tuple[torch.Tensor | None, bool]:
        if self.experts and self.dp_size > 1 and self.per_parameter_grads:
            self.experts.drop_unused(self._trained_params(), self.device)  # as one process skips them
        for hook in self.on_gradients:  # gradients exist only now
            hook(self)
        return self._optimizer_step()

    def _nonfinite(self, local: torch.Tensor) -> tuple[None, bool]:
        """Every rank read the same non-finite mean: name the ranks, then raise or skip."""
        bad = nonfinite_ranks(local, self.world_size)
        if self.spec.on_nonfinite == "raise":
            raise NonFiniteLossError(
                f"step {self.step + 1}: non-finite loss on rank(s) {sorted(bad)} "
                f"({'; '.join(f'rank {r}: loss {v}' for r, v in sorted(bad.items()))}); nothing "
                "was updated. Set on_nonfinite: skip to skip such steps, or check the data and lr")
        return self._skip_step(), False

    def check_finite(self, wait: bool = False) -> None:
        """raise_deferred: raise NonFiniteLossError for an earlier step's non-finite loss, once its
        record has landed (`wait`: read it now)."""
        if self.nonfinite is not None:
            self.nonfinite.check(self.step, wait)

    @torch.no_grad()
    def eval_step(self, batch) -> float:
        """The loss on `batch` (this rank's part of an evaluation batch), weighed as the step weighs
        it: the mean over the whole evaluation batch's items."""
        self.model.eval()
        batch = self._to_device(batch)
        counts = self.objective.counts([batch])
        total = pdist.PendingSum(counts.sum(), self.count_group) if counts is not None else None
        share = self.objective.share(self._loss(batch), 0, counts, total, 1)
        return float(pdist.all_mean(share.detach().float()))

    def _loss(self, batch) -> torch.Tensor:
        with self._autocast():
            if self.loss_fn is not None:
                return self.loss_fn(self.model, batch)
            return self.model(**batch).loss

    # ---- collectives and shutdown ----
    def barrier(self) -> None:
        if dist.is_initialized():
            phase = self.progress.phase
            self.progress.phase = f"{phase}, in a barrier"
            with self._guard("barrier"):
                dist.barrier()
            self.progress.phase = phase

    # ---- checkpoints: save/load/resume in calls.py, the trainer's own state here ----
    def trainer_state(self) -> dict:
        return {"step": self.step,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "loaders": self.loaders.state_dict()}

    def load_trainer_state(self, state: dict) -> None:
        self.step = state["step"]
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.loaders.load_state_dict(state["loaders"], self._say)
        if self.nonfinite is not None:
            self.nonfinite.at(self.step)
        self.preemption.at(self.step)

    def compile_stats(self) -> CompileStats | None:
        """What torch.compile did in this process (None without compile.enabled)."""
        return None if self.compile_watch is None else self.compile_watch.stats()

    def close(self) -> None:
        self.check_finite(wait=True)  # a deferred non-finite loss is never silently dropped
        self.checkpoints.close()  # an async save in flight is published (or raises) first
        self.tracker.close()
        if dist.is_initialized():
            dist.barrier()
            self._destroy_process_group()
