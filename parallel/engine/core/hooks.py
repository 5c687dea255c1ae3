"""The hooks a backend implements: everything the shared loop (engine.py) leaves to it, in one place.

A backend subclasses `Engine` and overrides these only (tests/unit/test_architecture.py fails a backend
that overrides anything else). The four abstract ones are required; the rest default to plain
single-device torch and are overridden where the backend differs. They may read the engine's state
(`spec`, `dims`, `device`, `model`, `optimizer`, `rank`, `is_main`, `objective`) and call its
set-up services (`_record_params`, `_optimizer_over`, `_apply_compile`, `say`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from parallel.checkpoint.state.sink import Sink
from parallel.engine.watch.nonfinite import NonfiniteWatch
from parallel.engine.model.params import per_parameter
from parallel.engine.watch.preempt import AgreedFlag
from parallel import dist as pdist
from parallel.engine.core.step import OptimizerArg
from parallel.engine.data.batches import split_micro_batches, to_device


class BackendHooks(ABC):
    name: str = "base"
    # Devices one process feeds. 1 except under SPMD, where one process drives every local device
    # and its step batch holds micro_batch_size x grad_accum_steps samples for each of them.
    devices_per_process: int = 1
    # The optimizer steps one tensor per parameter, so a parameter's gradient can be dropped (an
    # expert no rank used: experts.py). False where it steps flat tensors holding many parameters.
    per_parameter_grads: bool = True
    background_save: bool = True  # False where the state cannot be staged off the device (XLA)
    # A forward gathers parameters from other ranks (FSDP, ZeRO-3): every rank must then run the
    # same number of forwards (generate keeps them in step). False where forwards are local.
    forward_gathers: bool = True

    # ---- required ----
    @abstractmethod
    def _prepare(self, model, optimizer: OptimizerArg) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Build (from a factory) and shard `model`, calling `_record_params` before sharding and
        `_optimizer_over` after; return (the wrapped model, the optimizer over its shards)."""

    @abstractmethod
    def _optimizer_step(self) -> tuple[torch.Tensor | None, bool]:
        """Clip (if the spec says so), step, zero gradients; return (grad norm, whether it stepped)."""

    @abstractmethod
    def _save_model_optim(self, sink: Sink) -> None:
        """Write this rank's part of the model and optimizer state through `sink` (every state
        write goes through `portable.save_state(state, sink, ...)`)."""

    @abstractmethod
    def _load_model_optim(self, path: Path, manifest: dict, weights_only: bool = False) -> None:
        """Restore model and optimizer state from a verified checkpoint; `weights_only`: the
        model's weights and buffers alone (fp32 masters too where the backend keeps them), the
        optimizer left as it is: no state created, none read (engine.load(weights_only=True))."""

    # ---- optional: plain torch unless the backend differs ----
    def _split(self, batch) -> list:
        """The step batch as grad_accum_steps micro-batches."""
        return split_micro_batches(batch, self.spec.grad_accum_steps)  # rows checked by the guard

    def _to_device(self, batch):
        """One micro-batch onto the device (XLA SPMD also shards it)."""
        return to_device(batch, self.device)

    def _device_loader(self, loader: DataLoader):
        """Where batches meet the device; backends with their own input pipeline wrap `loader`."""
        return loader

    def _autocast(self):
        """Around forward: backends that cast by themselves (FSDP, DeepSpeed) need none."""
        return nullcontext()

    def _sync_context(self, last: bool):
        """Around a micro-batch's forward/backward: skip gradient reduction until the `last`."""
        return nullcontext()

    def _forward_backward(self, micro_batches: list, counts, total) -> torch.Tensor:
        """The step's forwards and backwards over its micro-batches, in order (under
        topology.pp the pipeline's schedule runs instead: engine.py); returns this rank's part
        of the step's loss, detached. `counts` / `total`: each micro-batch's items and the
        global count (objective.py)."""
        local = torch.zeros((), device=self.device)
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with self._sync_context(last):  # skip gradient reduction until the last micro-batch
                share = self.objective.share(self.forward(micro)[1], i, counts, total,
                                             len(micro_batches))
                if self.router is not None:  # the balancing loss over the global micro-batch
                    share = share + self.router.share(self._real_tokens(micro),
                                                      len(micro_batches), self.groups.dp)
                self._backward(share)
            local += share.detach().float()
        return local

    def _real_tokens(self, micro) -> torch.Tensor | None:
        """1 for each token of this rank's micro-batch that is not padding (a 2-D attention mask;
        with topology.cp, this rank's slice of it), None when every token is."""
        if self.context is not None:
            return self.context.real_tokens
        mask = micro.get("attention_mask")
        return mask if mask is not None and mask.dim() == 2 else None

    def _backward(self, share: torch.Tensor) -> None:
        """`share`: this micro-batch's part of the step's loss, already weighed (objective.py)."""
        share.backward()

    def _skip_step(self) -> None:
        """Drop this step's gradients without touching parameters or optimizer state."""
        self.optimizer.zero_grad(set_to_none=True)
        return None

    def _scheduled_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer whose param_groups' lr a scheduler sets."""
        return self.optimizer

    def _matrix_layout(self, model, p, name: str, shape: tuple):
        """Where this rank's elements of the 2-D parameter `p` of the sharded `model` (`name`,
        built as `shape`) sit, for torch.optim.Muon (parallel/engine/model/optim/muon.py): a
        DTensor's by its placements, None where `p` is the whole matrix here; anything else is
        refused. Backends that shard otherwise (FSDP1's flat views) give their own, or refuse."""
        from parallel.engine.model.optim.layouts import dtensor_layout
        from parallel.engine.model.optim.muon import MuonRefused

        if hasattr(p, "device_mesh"):
            return dtensor_layout(p)
        if tuple(p.shape) == tuple(shape):
            return None
        raise MuonRefused(f"optimizer: torch.optim.Muon over {name}: {self.name} holds it as a "
                          f"{tuple(p.shape)} tensor, not the {tuple(shape)} matrix, and Muon "
                          "orthogonalizes whole matrices; docs/optimizers.md lists the backends "
                          "that give them")

    def _trained_params(self):
        """(trained tensor, [its original name]) of every parameter the optimizer steps."""
        return per_parameter(self.model)

    def _nonfinite_watch(self) -> NonfiniteWatch:
        """Where raise_deferred keeps its record; backends whose device reports differently
        override it."""
        return NonfiniteWatch(self.device)

    def _agreed_flag(self) -> AgreedFlag:
        """How the preemption flag is read back; backends whose device reports differently
        override it."""
        return AgreedFlag(self.device)

    @contextmanager
    def _unwrapped(self):
        """The model as its library built it, callable directly (forward, generate) for the
        length of the block; the sharded model is the same object afterwards."""
        yield self.model

    def _generate(self, input_ids: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """transformers' generate on the unwrapped model, ranks in step where forwards gather."""
        from parallel.engine.infer.generate import hf_generate

        kwargs = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        with self._unwrapped() as model, self._autocast():
            out = hf_generate(model, input_ids.to(self.device),
                              synced=self.world_size > 1 and self.forward_gathers, **kwargs)
        return out.cpu()

    def _data_parallel_group(self):
        """The process group of the ranks holding other tokens of the step, data parallel x cp
        (parallel.dist.WORLD where every rank does): where the step's target count is summed. A
        backend whose library makes its own groups hands over its own."""
        if self.dims.dp_cp == self.world_size:
            return pdist.WORLD
        return pdist.data_parallel_group(self.device_mesh)

    def _context_group(self):
        """topology.cp's group: the ranks that split one row's tokens."""
        return self.device_mesh["cp"].get_group()

    def _release(self) -> None:
        """At close, before the last barrier: what the backend's library holds that must be let go
        while the process group lives (prefetched gathers), and registrations with other libraries
        that must not outlive the job."""

    def _destroy_process_group(self) -> None:
        """The job's process group, torn down at close; a backend whose library keeps groups of
        its own past it tears those down too."""
        torch.distributed.destroy_process_group()
        pdist.forget_meshes()

    def _forget_groups(self) -> None:
        """At close, when the process group outlives the job (the engine did not make it): what the
        backend's library keeps of this job's groups in module state, let go so that the next
        engine in this process makes its own. torch's meshes stay valid with the group."""

    def native_checkpoint(self):
        """(save(path), load(path)) of this backend's own checkpointing, as its docs write it, for
        `polyshard bench --save` to compare with; None where there is none to compare."""
        return None
