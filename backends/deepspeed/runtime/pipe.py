"""topology.pp through DeepSpeed's pipeline engine: this rank's stage (split as on every backend,
parallel/engine/model/pipeline/stages.py) as one layer of a `PipelineModule`, run by DeepSpeed's
PipelineEngine over its own 1F1B instructions, p2p and gradient reduction (pipe_config.py says what
runs and why).

What polyshard takes over, so that the step is one process's on the global batch:
- One TrainSchedule a step over every pipeline micro-batch of the step (DeepSpeed's accumulation
  steps, pipe_config.py), without its OptimizerStep: the engine's step decides the update (a
  non-finite loss is caught before it) and runs DeepSpeed's `_exec_optimizer_step` itself.
- The last stage's loss is the model's own causal-LM loss summed over the micro-batch's targets and
  divided by the step's count (parallel/engine/model/pipeline/schedule.py), times the accumulation
  steps, which DeepSpeed's backward divides every micro-batch's loss by.
- Activation shapes: DeepSpeed sends a stage's tensor shapes once and keeps its receive buffers;
  a batch of another width (padding to the longest row) resets them on every stage of the pipeline
  alike (its ranks are fed the same rows), DeepSpeed's `reset_activation_shape`.

A stage takes a tuple (ids or activations, then the batch's attention_mask / position_ids, which it
passes on) and gives the next stage the same tuple, the last stage its logits.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.engine.model.pipeline.schedule import PASSED, Pipeline


class Stage(nn.Module):
    """One stage as a PipelineModule layer (the part is shared with the engine's view)."""

    def __init__(self, part: nn.Module, last: bool, pipeline: DeepSpeedPipeline):
        super().__init__()
        self.part, self.last = part, last
        self.keys = pipeline.keys  # the batch's entries passed along, in order (set at the step)

    def forward(self, inputs):
        x, *passed = inputs if isinstance(inputs, tuple) else (inputs,)
        out = self.part(x, **dict(zip(self.keys, passed)))
        return out if self.last else (out, *passed)


class DeepSpeedPipeline(Pipeline):
    """The engine's Pipeline, run by DeepSpeed's PipelineEngine (`attach` it once initialized)."""

    def __init__(self, parts, layout, device, scale_grads: bool = False):
        super().__init__(parts, layout, device, scale_grads)
        self.keys: list[str] = []
        self.ds = None
        self._width: tuple | None = None
        self._factor = 1  # the accumulation steps DeepSpeed's backward divides by (training)

    def module(self, data_parallel: int):
        """This rank's stage in DeepSpeed's PipelineModule: one layer per stage (the others are
        placeholders PipelineModule never builds), pipe outermost as polyshard's mesh orders it."""
        from deepspeed.pipe import PipelineModule
        from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

        lay = self.layout
        layers: list[nn.Module] = [nn.Identity() for _ in range(lay.n_stages)]
        layers[lay.stage_ids[0]] = Stage(self.parts[0], self.last, self)
        return PipelineModule(layers, topology=PipeDataParallelTopology(lay.pp, data_parallel),
                              loss_fn=self._ds_loss, partition_method="uniform")

    def attach(self, ds) -> None:
        if ds.stage_id != self.layout.stage_ids[0]:  # the same rank order on both sides
            raise RuntimeError(f"DeepSpeed placed this rank at stage {ds.stage_id}, polyshard's "
                               f"mesh at {self.layout.stage_ids[0]}")
        self.ds = ds

    def _ds_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(logits, labels) * self._factor

    def forward_backward(self, micro_batches: list, total) -> torch.Tensor:
        """Every pipeline micro-batch of the step in one TrainSchedule, without its update."""
        from deepspeed.runtime.pipe.schedule import OptimizerStep, TrainSchedule

        self._denominator = total() / self.layout.data_parallel
        chunks = [c for micro in micro_batches for c in self._chunks(micro)]
        # scale_grads: DeepSpeed's own convention (train_batch: each micro-batch's own mean, divided
        # by the accumulation steps), kept to show the trap it is
        self._factor = 1 if self.scale_grads else len(chunks)
        steps = TrainSchedule(micro_batches=len(chunks), stages=self.layout.pp,
                              stage_id=self.ds.stage_id)
        self._execute(chunks, True, _Steps(steps, drop=OptimizerStep))
        return self._local()

    def run(self, micro: dict, denominator: torch.Tensor, training: bool) -> torch.Tensor:
        """An evaluation: the micro-batch's forwards (DeepSpeed's InferenceSchedule)."""
        from deepspeed.runtime.pipe.schedule import InferenceSchedule

        self._denominator, self._factor = denominator, 1
        chunks = self._chunks(micro)
        steps = InferenceSchedule(micro_batches=len(chunks), stages=self.layout.pp,
                                  stage_id=self.ds.stage_id)
        with torch.no_grad():
            self._execute(chunks, False, _Steps(steps))
        return self._local()

    def _chunks(self, micro: dict) -> list[tuple]:
        """The micro-batch as DeepSpeed's data iterator gives it: ((input, passed...), labels) per
        pipeline micro-batch."""
        self.keys[:] = [k for k in PASSED if micro.get(k) is not None]
        n = self.layout.microbatches
        split = [torch.tensor_split(micro[k], n) for k in ["input_ids", *self.keys]]
        return list(zip(zip(*split), torch.tensor_split(self._targets(micro), n)))

    def _execute(self, chunks: list[tuple], training: bool, steps) -> None:
        ds = self.ds
        width = tuple(chunks[0][0][0].shape)
        if width != self._width:  # every stage of the pipeline sees the same rows
            ds.reset_activation_shape()
            self._width = width
        ds.module.train(training)
        ds.total_loss, ds._compute_loss = None, True
        ds.set_dataiterator(iter(chunks))
        ds._exec_schedule(steps)

    def _local(self) -> torch.Tensor:
        """This rank's part of the loss, as Pipeline.run gives it: on the last stage the summed
        shares x pp (the engine's mean over the world is then the loss), elsewhere 0."""
        if not self.last:
            return torch.zeros((), device=self.device)
        outputs = self.ds.fwd_outputs
        each = len(outputs) if self.scale_grads and self.ds.module.training else self._factor
        return torch.stack([o.float() for o in outputs]).sum() / each * self.layout.pp


class _Steps:
    """A DeepSpeed schedule without the instructions of type `drop`."""

    def __init__(self, schedule, drop: type | None = None):
        self.schedule, self.drop = schedule, drop
        self.num_pipe_buffers = schedule.num_pipe_buffers

    def __iter__(self):
        for cmds in self.schedule:
            yield [c for c in cmds if self.drop is None or not isinstance(c, self.drop)]
