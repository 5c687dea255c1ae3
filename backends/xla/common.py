"""What XLA FSDP v1 and SPMD v2 engines share: the runtime set-up, MpDeviceLoader input, building
the model on the device (tied weights re-tied after the move), wrapping units, and the step's end
(`optimizer.step()` then `torch_xla.sync()`: FSDP has already reduce-scattered the gradients, so
`xm.optimizer_step`, which all-reduces them again, would be wrong)."""

from __future__ import annotations

import dataclasses
import threading

from torch import nn

from backends.xla.translate import translate
from parallel.engine.core.engine import Engine
from parallel.engine.watch.nonfinite import NonfiniteWatch
from parallel.engine.watch.preempt import AgreedFlag
from parallel.engine.core.step import check_built
from parallel.engine.model.params import aliases, retie
from parallel.engine.model.wrap import disable_kv_cache, plan_wrap
from parallel.spec.errors import SpecError
from parallel.spec.model import Spec
from parallel.kits.measurable import ModuleStateTensors


# torch_xla releases whose PJRT clients write the persistent cache but cannot read it back: every
# lookup fails with "Deserializing serialized executable not supported" and compiles again. Measured
# on the CPU client (docs/xla.md); TPU: pytorch/xla#9094, still reported on 2.9.0.
UNREADABLE_CACHE = ("2.9.",)


def apply_compilation_cache(path: str | None, version: str | None = None) -> None:
    """xla.compilation_cache, or a clear refusal where the installed torch_xla never reads it."""
    if not path:
        return
    import torch_xla

    version = version or torch_xla.__version__
    if version.startswith(UNREADABLE_CACHE):
        raise SpecError([("xla.compilation_cache", (
            f"{path!r}: torch_xla {version} writes its persistent compilation cache but cannot "
            "read it back ('Deserializing serialized executable not supported': measured on the "
            "CPU client, docs/xla.md; TPU: pytorch/xla#9094), so a relaunch compiles every graph "
            "again and each compile also pays a cache write. Remove xla.compilation_cache; with a "
            "torch_xla build that reads it back (pytorch/xla#9759) set XLA_PERSISTENT_CACHE_PATH "
            "yourself"))])
    import torch_xla.runtime as xr

    if not torch_xla._XLAC._xla_computation_cache_is_initialized():  # once per process
        xr.initialize_cache(path)


def apply_xla_fsdp(model: nn.Module, units, wrap, checkpoint: bool) -> nn.Module:
    """Wrap each unit (children first) in place with `wrap` (XLA FSDP v1 or FSDPv2), inside
    torch_xla's checkpoint_module when `checkpoint` (activation checkpointing), then the root."""
    from torch_xla.distributed.fsdp import checkpoint_module

    for name, unit in units:
        model.set_submodule(name, wrap(checkpoint_module(unit) if checkpoint else unit))
    return wrap(model)


MUON_NOTICE = "torch.optim.Muon runs its Newton-Schulz iteration"


class _Xla(ModuleStateTensors, Engine):
    name = "xla_fsdp"
    background_save = False  # its planners and gathers need the device (descriptor: capabilities)

    def __init__(self, spec: Spec, **context):
        self.plan = translate(spec)
        apply_compilation_cache(spec.xla.compilation_cache)  # before the runtime's first compile
        self._before_runtime()
        super().__init__(spec, **context)
        import torch_xla

        self.ctx = dataclasses.replace(self.ctx, device=torch_xla.device())
        self.shapes = ShapeWatch()  # a compile per batch shape: said once (dynamic padding)
        self._check_runtime()

    def _before_runtime(self) -> None:
        pass

    def _check_runtime(self) -> None:
        pass

    def _matrix_layout(self, model, p, name: str, shape: tuple):
        if not any(n.startswith(MUON_NOTICE) for n in self.notices):
            self.say(f"{MUON_NOTICE} in bf16, and XLA computes bf16 matmuls otherwise than eager "
                     "torch on the CPU: the update is XLA's own (one device, the tiny Llama: the "
                     "loss 7.4e-4 from eager torch's after 5 steps; docs/optimizers.md)")
        return self._xla_matrix_layout(model, p, name, shape)

    def _xla_matrix_layout(self, model, p, name: str, shape: tuple):
        return super()._matrix_layout(model, p, name, shape)  # SPMD: whole, the global view

    def _device_loader(self, loader):
        """Batches reach the device through MpDeviceLoader: host-to-device copies overlap the step."""
        import torch_xla.distributed.parallel_loader as pl

        return pl.MpDeviceLoader(loader, self.device, **self._input_sharding())

    def _input_sharding(self) -> dict:
        return {}

    def _build(self, model) -> tuple[nn.Module, list]:
        model = model if isinstance(model, nn.Module) else model()
        check_built(model)
        plan = self._record_params(model)
        if self.experts:
            self.say(f"{self.experts.summary()} route each step's tokens with data-dependent shapes "
                      "(the experts a step hits, the rows each gets), and XLA compiles a graph for "
                      "every new shape: measured on the CPU client with a 2-layer Mixtral, 37 graphs "
                      "a step and 4-12 s a step for ever; on TPUs use a static-shape MoE layer "
                      "(docs/moe.md)")
        units = plan_wrap(model, self.spec.wrap)
        if self.spec.checkpoint_activations:
            disable_kv_cache(model)
        model = model.to(self.device)
        retie(model, plan.tied)  # .to(xla) gives every module its own copy of a tied weight
        return model, units

    def _aliased(self, model: dict) -> dict:
        """Tied weights under each of their names, as the model's state_dict() has them."""
        for alias, canonical in aliases(self.params.tied).items():
            if canonical in model:
                model[alias] = model[canonical]
        return model

    def _generate(self, input_ids, kwargs: dict):
        """Static shapes: one graph per (rows, bucketed width), every step alike (generate.py)."""
        import torch
        import torch_xla

        from parallel.engine.infer.generate import check_static, library_model, static_generate

        model = library_model(self.model)
        check_static(model, kwargs)
        with torch.no_grad(), self._autocast():
            # through the sharded wrapper: its forward gathers (v1) or is partitioned (SPMD)
            return static_generate(model, self.model, input_ids, end_step=torch_xla.sync,
                                   place=self._generation_layout(len(input_ids)),
                                   device=self.device, **kwargs)

    def _generation_layout(self, rows: int):
        """How generate's step-to-step tensors are laid out (SPMD pins them)."""
        return lambda t: None

    def _agreed_flag(self) -> AgreedFlag:
        return _XlaAgreedFlag(self.device)

    def _nonfinite_watch(self) -> NonfiniteWatch:
        return _XlaWatch(self.device)

    def _forward_backward(self, micro_batches: list, counts, total):
        self.shapes.see(micro_batches, self.step, self.say)
        return super()._forward_backward(micro_batches, counts, total)

    def _skip_step(self):
        import torch_xla

        self.optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()  # end the skipped step's graph here, as a taken step's would end
        return None

    def _finish_step(self, norm):
        import torch_xla

        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()  # one compiled graph per step: forward, backward, update
        return norm, True


class ShapeWatch:
    """XLA compiles one graph per input shape: a dataloader padding each batch to its longest row
    (Hugging Face's dynamic padding) recompiles nearly every step (measured: 3,709 ms/step against
    79 on FSDP2; an SFT job 104.7 s dynamic, 37.1 s padded to one width). Said once, with the
    numbers, when a third width appears."""

    LIMIT = 3

    def __init__(self):
        self.widths: set[tuple] = set()
        self.said = False

    def see(self, micro_batches: list, step: int, say) -> None:
        if self.said:  # said once: nothing more to track on the hot path
            return
        for micro in micro_batches:
            ids = micro.get("input_ids") if isinstance(micro, dict) else None
            if ids is not None and hasattr(ids, "shape"):
                self.widths.add(tuple(ids.shape))
        if len(self.widths) >= self.LIMIT and not self.said:
            self.said = True
            shown = sorted(self.widths)[:6]
            say(f"XLA compiles one graph per batch shape, and by step {step + 1} the batches had "
                f"{len(self.widths)} ({', '.join('x'.join(map(str, s)) for s in shown)}...): each "
                "new one costs a compile (dynamic padding measured 47x slower per step than fixed "
                "widths, docs/xla.md). Pad to a few fixed widths: a collator's "
                "pad_to_multiple_of=64 (or padding='max_length'); labels -100 and attention_mask 0 "
                "on the padding leave the loss unchanged")


class _XlaWatch(NonfiniteWatch):
    """raise_deferred on XLA: the record is part of the step's graph, and a step closure copies it to
    the host once that graph has run, on torch_xla's closure thread (run_async): the step never
    waits for it, and no extra graph is cut (a host read before the update would split each step's
    graph in two: docs/reliability.md)."""

    def publish(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.add_step_closure(self._landed, args=(self.first,), run_async=True)

    def _landed(self, first) -> None:
        self.host.copy_(first.cpu())


class _XlaAgreedFlag(AgreedFlag):
    """The preemption flag on XLA: copied by a step closure once its graph has run (the step never
    waits); read three steps later, by when torch_xla's closure thread has long run it."""

    lag = 3

    def record(self, step: int, reduced) -> None:
        import torch_xla.core.xla_model as xm

        host, landed = self._buffer(), threading.Event()
        xm.add_step_closure(self._landed, args=(reduced, host, landed), run_async=True)
        self.ring.append((step, host, landed))

    @staticmethod
    def _landed(reduced, host, landed) -> None:
        host.copy_(reduced.reshape(1).float().cpu())
        landed.set()
