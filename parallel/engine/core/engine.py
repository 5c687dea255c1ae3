"""The Engine: prepare (setup.py) -> train_step / eval_step -> save / load -> close.

`train_step` is a template, read top to bottom: check the batch, split it into micro-batches, forward
and backward them (`_forward_backward`, the backend's loop over `model`; under topology.pp the
pipeline's schedule over `model_parts`, this rank's stages: parallel/engine/model/pipeline/),
reduce the loss, one optimizer step. Backends fill in only what differs, through the hooks of
hooks.py, and nothing else. What is not the step is a part the engine owns (setup.py lists them)
and calls at a named point.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from parallel import dist as pdist
from parallel.engine.core.setup import EngineSetup
from parallel.engine.core.step import StepResult
from parallel.engine.data.batches import batch_width, count_tokens
from parallel.engine.data.guard import BatchError, batch_problem
from parallel.engine.data.loaders import plain_batch
from parallel.engine.data.packing import flattened_problem
from parallel.engine.watch.hang import CollectiveTimeout, is_timeout, timeout_error
from parallel.engine.watch.nonfinite import NonFiniteLossError, nonfinite_ranks
from parallel.kits import device as devices


class Engine(EngineSetup):
    """What every backend's engine is: the set-up (setup.py), the public calls that hand to a part
    (calls.py), and the step below. Backends implement the hooks of `BackendHooks` (hooks.py) and
    override nothing else (tests/unit/test_architecture.py holds them to it)."""

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
        if problem is None and not self.confines_flattened:
            problem = flattened_problem(batch)
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
        ranks that are elsewhere, and where (parallel/engine/watch/hang.py)."""
        try:
            yield
        except RuntimeError as err:
            if isinstance(err, CollectiveTimeout) or not is_timeout(err):
                raise
            raise timeout_error(self.rank, self.world_size, what, self.spec.timeout_s,
                                self.progress, self.spec.checkpoint.dir or os.getcwd()) from err

    def _train_step(self, batch, start: float) -> StepResult:
        for part in self.model_parts:
            part.train()
        micro_batches = [self._local(m) for m in self._split(batch)]
        # Each micro-batch weighs by the items its loss averages over (objective.py), so the step's
        # loss and gradient are one process's on the global batch. The global count is one small
        # reduction over the data-parallel ranks, in flight during the first forward and waited
        # for at the first backward.
        counts = self.objective.counts(micro_batches)
        total = pdist.PendingSum(counts.sum(), self.groups.dp) if counts is not None else None
        self.progress.phase = "forward/backward"
        local = (self._forward_backward(micro_batches, counts, total) if self.pipeline is None
                 else self.pipeline.forward_backward(micro_batches, total))  # the stages' schedule
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this update uses (schedule moves after)
        self.checkpoints.staged()  # an async save's copies of what the update changes have landed
        self.progress.phase = "optimizer step"
        if self.nonfinite is None:  # raise | skip: decided before the update
            # The mean over ranks is non-finite exactly when some rank's loss is: the reduction a
            # logging loop does anyway carries the decision, and one host read makes it.
            mean, value = self._reduce_loss(local, read=True)
            grad_norm, stepped = (self._update() if math.isfinite(value)
                                  else self._nonfinite(local))
        elif self._drops_experts():  # raise_deferred, and the experts' use is read before the
            # update: the loss travels with it, and that one read is the step's loss read too
            mean, value = self._reduce_loss(local, read=True)
            grad_norm, stepped = self._update()
            self.nonfinite.record(mean, local)
        else:  # raise_deferred: nothing waits for the loss; the record is checked later
            grad_norm, stepped = self._update()
            mean, value = self._reduce_loss(local, read=False)
            self.nonfinite.record(mean, local)
        if self.scheduler is not None and stepped:
            self.scheduler.step()
        self.step += 1
        return StepResult(step=self.step, loss_tensor=mean, grad_norm_tensor=grad_norm, lr=lr,
                          tokens=count_tokens(batch) * self.dp_size,
                          targets_tensor=total() if total is not None else None,
                          step_time=time.perf_counter() - start, stepped=stepped,
                          loss_value=value, metrics=self._take_metrics())

    def _reduce_loss(self, local: torch.Tensor, read: bool) -> tuple[torch.Tensor, float | None]:
        """The step's one reduction, over the world: the mean loss and, in the same tensor (no
        second collective), what every rank must see of the step (`_riders`). Returns (mean, its
        value where read: `read`, or where the experts' use rides along, whose one host read
        brings the loss too)."""
        riders = self._riders(local.device)
        if not riders:
            mean = pdist.all_mean(local, self.groups.world)
            return mean, float(mean) if read else None
        packed = pdist.all_mean(torch.cat([local.float().reshape(1), *riders.values()]),
                                self.groups.world)
        got = dict(zip(riders, packed[1:].split([t.numel() for t in riders.values()])))
        if "preempt" in got:
            self.preemption.record(self.step + 1, got["preempt"][0])
        if "loads" in got:  # summed over ranks, for the trackers (read at the log); the tp ranks
            # of a group dispatch the same tokens (a block's input is whole on each)
            loads = got["loads"].view(len(self.expert_parallel.blocks), -1) * (
                self.world_size // self.dims.tp)
            self._step_metrics = self.expert_parallel.load_metrics(loads)
        if "use" not in got:
            return packed[0], float(packed[0]) if read else None
        host = packed.tolist()  # the loss and the experts' use, in one read
        self._expert_use = [n * self.world_size for n in host[-len(got["use"]):]]
        return packed[0], host[0]

    def _riders(self, device) -> dict[str, torch.Tensor]:
        """What travels in the loss reduction, each a flat float tensor averaged over the world:
        the ranks that caught a preemption signal (preempt.py); at a logging step under ep, each
        rank's tokens per expert (the trackers'); where the update drops unused experts, their use
        (experts.py), which the host reads before the update (last: read with the loss)."""
        out = {}
        flag = self.preemption.flag(device)
        if flag is not None:
            out["preempt"] = flag.float().reshape(1)
        if self.expert_parallel is not None and self.tracker.logs_at(self.step + 1):
            out["loads"] = self.expert_parallel.take_tokens(device).flatten()
        if self._drops_experts():
            out["use"] = self.experts.use_of_step(device)
        return out

    def _take_metrics(self):
        metrics, self._step_metrics = self._step_metrics, None
        return metrics

    def _drops_experts(self) -> bool:
        """Experts no rank used get no update (experts.py): several ranks, per-parameter updates."""
        return bool(self.experts) and self.dims.dp_cp > 1 and self.per_parameter_grads

    def _update(self) -> tuple[torch.Tensor | None, bool]:
        if self._drops_experts():  # as one process skips them
            summed, self._expert_use = self._expert_use, None  # from the loss's reduction
            self.experts.drop_unused(self._trained_params(), self.device, self.groups.world,
                                     summed)
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
        for part in self.model_parts:
            part.eval()
        batch = self._local(batch)
        counts = self.objective.counts([batch])
        total = pdist.PendingSum(counts.sum(), self.groups.dp) if counts is not None else None
        if self.pipeline is not None:  # the stages' forwards; the last stage's loss (x pp)
            share = self.pipeline.run(batch, total() / self.dims.dp_cp, training=False)
        else:
            share = self.objective.share(self.forward(batch)[1], 0, counts, total, 1)
        return float(pdist.all_mean(share.detach().float(), self.groups.world))

    def forward(self, batch, logits: bool = False) -> tuple[object | None, torch.Tensor]:
        """(the model's outputs, its loss) on one micro-batch on the device, under the backend's
        autocast: `loss_fn(model, batch)` (outputs None), else the Hugging Face model's `.loss`.
        What the step, eval_step and evaluate run. With sequence.loss_tile the outputs carry no
        logits, unless `logits` (evaluate's metrics read them: then the loss is not tiled)."""
        offload = self.spec.sequence.offload_activations  # saved tensors in host memory
        router = nullcontext()
        batch = self.forward_kwargs.of(batch)  # use_cache=False, ... (wrap.py)
        if self.router is not None and self.model.training:  # the router's logits kept for
            router = self.router.capture()  # the balancing loss over the global batch (router.py)
        with self._autocast(), router, (torch.autograd.graph.save_on_cpu(
                devices.on_accelerator(self.device)) if offload else nullcontext()):
            if self.loss_fn is not None:
                return None, self.loss_fn(self.model, batch)
            if self.tiled is not None and not logits:  # sequence.loss_tile: never whole
                return self.tiled.forward(self.model, batch)
            outputs = self.model(**batch)
            return outputs, outputs.loss

    def device_batch(self, batch):
        """A loader's batch (a BatchEncoding too) on the device as the backend places it, and with
        topology.cp this rank's tokens of it (context_parallel.py)."""
        return self._local(plain_batch(batch))

    def _local(self, batch):
        batch = self._to_device(batch)
        return batch if self.context is None else self.context.shard(batch)

    # ---- collectives and shutdown ----
    def barrier(self) -> None:
        if dist.is_initialized():
            phase = self.progress.phase
            self.progress.phase = f"{phase}, in a barrier"
            with self._guard("barrier"):
                dist.barrier()
            self.progress.phase = phase

    def close(self) -> None:
        # checkpoint.hf_at_end first: it reads the model's shards over the live process group
        self.checkpoints.at_end()
        if self.context is not None:  # the model attends on its own again (no group after close)
            self.context.release()
        self._release()  # what the backend holds that needs the process group
        self.check_finite(wait=True)  # a deferred non-finite loss is never silently dropped
        self.checkpoints.close()  # an async save in flight is published (or raises) first
        self.tracker.close()
        self.hang.close()  # the barrier below is this engine's last collective, not a user's
        if dist.is_initialized():
            dist.barrier()
            # only a group this engine made: the user's own (or another engine's, still training,
            # measured: a ZeRO-3 engine's close then raised "DeepSpeed backend not set") lives on,
            # and the backend's library lets go of the groups it derived for this job
            if self.ctx.created:
                self._destroy_process_group()
            else:
                self._forget_groups()
        pdist.restore_launch_env(self._launch_env)
