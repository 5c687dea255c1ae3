"""The interface every backend implements, and the training loop they share.

`train_step` is a template: split the step's batch into micro-batches, forward/backward each, then one
optimizer step. Backends fill in only what differs (how to wrap the model, how to run backward, how to
clip and step), so the loop reads top to bottom in one place.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from parallel.engine import dist as pdist
from parallel.engine.data import ResumableLoader, ResumableSampler
from parallel.engine.dims import ParallelDims
from parallel.engine.checkpointing import CheckpointMixin
from parallel.engine.compiling import CompileMixin
from parallel.engine.guards import (
    BatchError,
    NonFiniteLossError,
    NonfiniteWatch,
    batch_problem,
    nonfinite_ranks,
)
from parallel.engine.hang import PROGRESS, CollectiveTimeout, HangWatch, is_timeout, timeout_error
from parallel.engine.preempt import PreemptionMixin
from parallel.engine.experts import Experts
from parallel.engine.objective import CountFn, Objective
from parallel.engine.params import ParamGroupsHook, ParamPlan, per_parameter
from parallel.engine.step import (
    LossFn,
    OptimizerArg,
    StepResult,
    build_optimizer,
    count_tokens,
    split_micro_batches,
    to_device,
)
from parallel.spec.model import Spec

class Engine(CheckpointMixin, PreemptionMixin, CompileMixin, ABC):
    """prepare -> train_step / eval_step -> save / load -> close."""

    name: str = "base"
    # Devices one process feeds. 1 except under SPMD, where one process drives every local device
    # and its step batch holds micro_batch_size x grad_accum_steps samples for each of them.
    devices_per_process: int = 1
    # The optimizer steps one tensor per parameter, so a parameter's gradient can be dropped (an
    # expert no rank used: experts.py). False where it steps flat tensors holding many parameters.
    per_parameter_grads: bool = True

    def __init__(self, spec: Spec):
        self.spec = spec
        self.ctx = pdist.init_distributed(spec.timeout_s)
        HangWatch.start(self.ctx.rank)  # idle until a collective times out; never per step
        self.dims = ParallelDims.from_spec(spec)  # the data-parallel layout, built once
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
        self.loaders: list[ResumableLoader] = []
        # Called with the engine once a step's gradients exist, before the update (bench measures
        # gradient memory here): an extension point, empty by default.
        self.on_gradients: list[Callable[[Engine], None]] = []
        self._batch_signature: dict | None = None  # the first batch's keys/dtypes, later held to
        self._param_groups_hook: ParamGroupsHook | None = None
        self.params: ParamPlan | None = None  # set by the backend before sharding
        self._watch: NonfiniteWatch | None = None  # on_nonfinite: raise_deferred, from prepare()

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
        """The torch DeviceMesh over (dp_replicate, dp_shard), made on first use (backends that
        shard with torch's DeviceMesh take it or a slice of it)."""
        return self.dims.device_mesh(self.device.type)

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
            self._watch = self._nonfinite_watch()
        self._install_preemption()
        return self.model

    def _nonfinite_watch(self) -> NonfiniteWatch:
        """Where raise_deferred keeps its record; backends whose device reports differently
        override it."""
        return NonfiniteWatch(self.device)

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

    def _scheduled_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer whose param_groups' lr a scheduler sets."""
        return self.optimizer

    @abstractmethod
    def _prepare(self, model, optimizer: OptimizerArg) -> tuple[nn.Module, torch.optim.Optimizer]:
        ...

    def dataloader(self, dataset, batch_size: int | None = None, shuffle: bool = True,
                   collate_fn=None) -> ResumableLoader:
        """Per-rank loader of step batches (micro_batch_size * grad_accum_steps samples each) whose
        position is saved and restored with the checkpoint."""
        size = batch_size or self.samples_per_step
        sampler = ResumableSampler(len(dataset), self.dp_size, self.dp_rank, self.spec.seed, shuffle)
        loader = DataLoader(dataset, batch_size=size, sampler=sampler, collate_fn=collate_fn,
                            drop_last=True)
        self.loaders.append(ResumableLoader(self._device_loader(loader), sampler, size))
        return self.loaders[-1]

    def _device_loader(self, loader: DataLoader):
        """Where batches meet the device; backends with their own input pipeline wrap `loader`."""
        return loader

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
        self._check_start()  # first call only: a signal during start-up exits without a save
        if self._preempted is not None:  # saved at the end of the previous step: exit to requeue
            raise self._preempted
        self._check_finite()  # raise_deferred: an earlier step's record, if it has landed
        PROGRESS.at(self.step + 1, "checking the batch")
        problem, signature = batch_problem(batch, self._batch_signature, self.samples_per_step)
        if problem is not None:
            raise BatchError(f"step {self.step + 1}: rank {self.rank}: {problem}")
        self._batch_signature = self._batch_signature or signature
        with self._guard(f"step {self.step + 1}"):
            result = self._train_step(batch, start)
            self._maybe_preempt()  # every rank alike: an agreed signal saves here
        PROGRESS.at(self.step, "done")
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
                                self.spec.checkpoint.dir or os.getcwd()) from err

    def _train_step(self, batch, start: float) -> StepResult:
        self.model.train()
        micro_batches = [self._to_device(m) for m in self._split(batch)]
        # Each micro-batch weighs by the items its loss averages over (objective.py), so the step's
        # loss and gradient are one process's on the global batch. The global count is one small
        # reduction, in flight during the first forward and waited for at the first backward.
        counts = self.objective.counts(micro_batches)
        total = pdist.PendingSum(counts.sum()) if counts is not None else None
        local = torch.zeros((), device=self.device)
        PROGRESS.phase = "forward/backward"
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with self._sync_context(last):  # skip gradient reduction until the last micro-batch
                share = self.objective.share(self._loss(micro), i, counts, total,
                                             len(micro_batches))
                self._backward(share)
            local += share.detach().float()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this update uses (schedule moves after)
        PROGRESS.phase = "optimizer step"
        if self._watch is None:  # raise | skip: decided before the update
            # The mean over ranks is non-finite exactly when some rank's loss is: the reduction a
            # logging loop does anyway carries the decision, and one host read makes it.
            mean = self._reduce_loss(local)
            value = float(mean)
            grad_norm, stepped = (self._update() if math.isfinite(value)
                                  else self._nonfinite(local))
        else:  # raise_deferred: nothing waits for the loss; the record is checked later
            grad_norm, stepped = self._update()
            mean, value = self._reduce_loss(local), None
            self._watch.record(mean, local)
        if self.scheduler is not None and stepped:
            self.scheduler.step()
        self.step += 1
        self._compile_after_step()  # compile.enabled: host-only checks that it ran compiled
        return StepResult(step=self.step, loss_tensor=mean, grad_norm_tensor=grad_norm, lr=lr,
                          tokens=count_tokens(batch) * self.dp_size,
                          targets_tensor=total() if total is not None else None,
                          step_time=time.perf_counter() - start, stepped=stepped,
                          loss_value=value)

    def _update(self) -> tuple[torch.Tensor | None, bool]:
        if self.experts and self.dp_size > 1 and self.per_parameter_grads:
            self._drop_unused_experts()
        for hook in self.on_gradients:  # gradients exist only now
            hook(self)
        return self._optimizer_step()

    def _drop_unused_experts(self) -> None:
        """Experts no rank used this step got zero gradients (experts.py): drop them, so the
        optimizer skips them as one process does. One small sum over ranks and one host read, for
        mixture-of-experts models only (whose blocks read their routing to the host anyway)."""
        used = torch.tensor(self.experts.step_done(), dtype=torch.float32, device=self.device)
        unused = [i for i, n in enumerate(pdist.PendingSum(used)().tolist()) if n == 0]
        if unused:
            names = set(self.experts.param_names(unused))
            for p, (name,) in self._trained_params():
                if name in names:
                    p.grad = None

    def _trained_params(self):
        """(trained tensor, [its original name]) of every parameter the optimizer steps."""
        return per_parameter(self.model)

    def _nonfinite(self, local: torch.Tensor) -> tuple[None, bool]:
        """Every rank read the same non-finite mean: name the ranks, then raise or skip."""
        bad = nonfinite_ranks(local, self.world_size)
        if self.spec.on_nonfinite == "raise":
            raise NonFiniteLossError(
                f"step {self.step + 1}: non-finite loss on rank(s) {sorted(bad)} "
                f"({'; '.join(f'rank {r}: loss {v}' for r, v in sorted(bad.items()))}); nothing "
                "was updated. Set on_nonfinite: skip to skip such steps, or check the data and lr")
        return self._skip_step(), False

    def _check_finite(self, wait: bool = False) -> None:
        if self._watch is not None:
            self._watch.check(self.step, wait)

    def _skip_step(self) -> None:
        """Drop this step's gradients without touching parameters or optimizer state."""
        self.optimizer.zero_grad(set_to_none=True)
        return None

    @torch.no_grad()
    def eval_step(self, batch) -> float:
        """The loss on `batch` (this rank's part of an evaluation batch), weighed as the step weighs
        it: the mean over the whole evaluation batch's items."""
        self.model.eval()
        batch = self._to_device(batch)
        counts = self.objective.counts([batch])
        total = pdist.PendingSum(counts.sum()) if counts is not None else None
        share = self.objective.share(self._loss(batch), 0, counts, total, 1)
        return float(pdist.all_mean(share.detach().float()))

    def _loss(self, batch) -> torch.Tensor:
        with self._autocast():
            if self.loss_fn is not None:
                return self.loss_fn(self.model, batch)
            return self.model(**batch).loss

    def _autocast(self):
        return nullcontext()  # backends that cast by themselves (FSDP, DeepSpeed) need none

    def _sync_context(self, last: bool):
        return nullcontext()

    def _backward(self, share: torch.Tensor) -> None:
        """`share`: this micro-batch's part of the step's loss, already weighed (objective.py)."""
        share.backward()

    @abstractmethod
    def _optimizer_step(self) -> tuple[torch.Tensor | None, bool]:
        """Clip (if the spec says so), step, zero gradients; return (grad norm, whether it stepped)."""

    def _split(self, batch) -> list:
        return split_micro_batches(batch, self.spec.grad_accum_steps)  # rows checked by the guard

    def _to_device(self, batch):
        return to_device(batch, self.device)

    # ---- collectives and shutdown ----
    def barrier(self) -> None:
        if dist.is_initialized():
            phase = PROGRESS.phase
            PROGRESS.phase = f"{phase}, in a barrier"
            with self._guard("barrier"):
                dist.barrier()
            PROGRESS.phase = phase

    def load_trainer_state(self, state: dict) -> None:
        super().load_trainer_state(state)
        if self._watch is not None:
            self._watch.at(self.step)
        if self._agreed is not None:
            self._agreed.at(self.step)

    def native_checkpoint(self):
        """(save(path), load(path)) of this backend's own checkpointing, as its docs write it, for
        `polyshard bench --save` to compare with; None where there is none to compare."""
        return None

    def close(self) -> None:
        self._check_finite(wait=True)  # a deferred non-finite loss is never silently dropped
        self._saver.wait()  # an async save in flight is published (or its error raised) first
        self._saver.pinned.release()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
