"""topology.pp's step: torch.distributed.pipelining's schedules over this rank's stages, weighed so that
the loss and gradients are one process's on the global batch.

torch's schedules divide every gradient by the number of pipeline micro-batches (`scale_grads=True`,
their default) and expect a loss that is each micro-batch's own mean: a mean of means, which differs
from the global batch's mean as soon as micro-batches hold different numbers of target tokens (padded
rows; measured in tests/distributed/test_pipeline.py, where the default is kept as the trap it is).
Here `scale_grads=False` and the last stage's loss is the model's own loss function summed over the
micro-batch's targets and divided by the step's global count over the data-parallel ranks (the count
`kits/objective.py` makes for every layout): each micro-batch then adds exactly its share.

torch's stages receive activations into buffers shaped by the first batch they see; a batch of
another shape (padding to the longest row) gets a schedule of its own, made on every stage of the
pipeline alike (the ranks of one pipeline are fed the same rows) and kept for the next such batch.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import schedules as ts

from parallel.dist import union_names

# torch 2.15's step(finalize_gradients=False) leaves FSDP stages' gradients unreduced for a later call
# (torch 2.9 lacks it: each call reduces)
DEFERS = "finalize_gradients" in inspect.signature(ts._PipelineSchedule.step).parameters
SINGLE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
MULTI = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "zbv": "ScheduleZBVZeroBubble",
         "dualpipev": "ScheduleDualPipeV"}
V_SHAPED = ("zbv", "dualpipev")  # rank r holds stages r and 2 pp - 1 - r; the others loop
PASSED = ("attention_mask", "position_ids")  # what every stage reads beside its input


def stage_ids(schedule: str, pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stages rank `pp_rank` of the pipeline holds, in order."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


@dataclass
class PipelineLayout:
    schedule: str  # pipeline.schedule
    microbatches: int  # pipeline micro-batches per engine micro-batch
    stage_ids: list[int]  # this rank's stages
    n_stages: int  # pp x virtual stages
    pp: int
    group: object  # the pp process group
    data_parallel: int  # ranks holding other tokens of the step (dp x cp): the count's divisor


class Pipeline:
    """Runs a step, or an evaluation, of this rank's stages. `parts`: the stage modules (sharded)."""

    def __init__(self, parts: list[nn.Module], layout: PipelineLayout, device: torch.device,
                 scale_grads: bool = False):
        self.parts, self.layout, self.device = parts, layout, device
        self.scale_grads = scale_grads  # True only to show torch's default (the trap)
        self.elsewhere: frozenset[str] = frozenset()  # the model's entries other stages hold
        self.first = 0 in layout.stage_ids
        self.last = layout.n_stages - 1 in layout.stage_ids
        self._schedules: dict = {}
        # (stage, pipeline micro-batch shape) -> the stage's input as meta tensors, where they are
        # known without asking the previous stage (a dry run: the fake group carries no objects)
        self.given_inputs: Callable[[int, tuple], tuple] | None = None
        self._whole: list[list[str]] | None = None  # whole_groups, once gathered
        self._denominator: torch.Tensor | None = None
        self._shifted = False  # the micro-batch's targets come shifted (topology.cp's split)
        self._loss = _causal_lm_loss(parts[layout.stage_ids.index(layout.n_stages - 1)]
                                     if self.last else None)

    def _loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # the model's own causal-LM loss, summed over the micro-batch's targets / the global count;
        # under topology.cp the targets come shifted before the split (`shift_labels`: shifting a
        # rank's part of the row again would pair each position with the token after its target)
        given = {"shift_labels": labels} if self._shifted else {}
        if self.scale_grads:  # torch's convention: each micro-batch's own mean
            return self._loss(logits, labels, logits.shape[-1], **given)
        return self._loss(logits, labels, logits.shape[-1], num_items_in_batch=self._denominator,
                          **given)

    def _schedule(self, shape: tuple, training: bool):
        key = (shape, training)
        if key not in self._schedules:
            self._schedules[key] = self._make(training, shape)
        return self._schedules[key]

    def _stages(self, shape: tuple, training: bool) -> list:
        from torch.distributed import pipelining

        lay = self.layout
        stages = [pipelining.PipelineStage(part, s, lay.n_stages, self.device, group=lay.group,
                                           **self._shapes(part, s, shape, training))
                  for part, s in zip(self.parts, lay.stage_ids)]
        for stage in stages:  # torch 2.15's probe of the first step's shapes is no step's forward
            if hasattr(stage, "register_forward_context"):
                stage.register_forward_context(_probe_context)
        if torch.distributed.get_backend(lay.group) == "gloo":
            # torch 2.9's first-step handshake (it warms NCCL's p2p communicators up) sends an
            # int64 into a float32 buffer: gloo refuses it (measured: "op.preamble.length <=
            # op.nbytes. 8 vs 4"), and gloo needs no warm-up
            for stage in stages:
                stage._get_init_p2p_neighbors_ops = list
        return stages

    def _shapes(self, part: nn.Module, stage: int, shape: tuple, training: bool) -> dict:
        """torch's own shape inference (an exchange with the neighbouring stages at the first step
        of each shape), unless `given_inputs` knows the input: then the output is what the part
        makes of zeros, as torch's inference computes it. In training the examples say they
        require grad: torch 2.15 derives the gradients a stage receives and sends from that flag
        (none where it is off: its backward then met a None output gradient, measured)."""
        if self.given_inputs is None:
            return {}
        chunk = (shape[0] // self.layout.microbatches, *shape[1:])
        inputs = (torch.zeros(chunk, dtype=torch.long, device=self.device),) if stage == 0 else \
            tuple(torch.zeros_like(t, device=self.device) for t in self.given_inputs(stage, chunk))
        with torch.no_grad():
            out = part(*inputs)
        return {"input_args": tuple(t.to("meta").requires_grad_(training and t.is_floating_point())
                                    for t in inputs),
                "output_args": out.to("meta").requires_grad_(training)}

    def _make(self, training: bool, shape: tuple):
        """torch's schedule for this layout. Two run on torch's action runtime instead of their
        own loop: zbv, whose loop sends activations between a rank's two adjacent stages to itself
        (gloo cannot: "Pair is not connected", measured; the runtime passes them in memory), and
        every multi-stage evaluation (dualpipev's own order runs backward actions even in eval:
        "can't steal_bwd_input if this stage doesn't have backward"), as forwards alone, stage by
        stage."""
        lay, stages = self.layout, self._stages(shape, training)
        args = {"n_microbatches": lay.microbatches, "loss_fn": self._loss_fn,
                "scale_grads": self.scale_grads}
        if lay.schedule in SINGLE:
            return getattr(ts, SINGLE[lay.schedule])(stages[0], **args)
        if training and lay.schedule != "zbv":
            return getattr(ts, MULTI[lay.schedule])(stages, **args)
        if training:  # zbv's order, run by the runtime
            runtime = ts._PipelineScheduleRuntime(stages, **args)
            runtime._prepare_schedule_with_comms(ts.ScheduleZBVZeroBubble(stages, **args)
                                                 .pipeline_order)
            return runtime
        held = {r: stage_ids(lay.schedule, r, lay.pp, len(stages)) for r in range(lay.pp)}
        runtime = _ForwardOnly(stages, **args)
        runtime.mapping = {s: r for r, ids in held.items() for s in ids}
        runtime._prepare_schedule_with_comms({r: [
            ts._Action(s, ts._ComputationType.FORWARD, mb) for s in ids
            for mb in range(lay.microbatches)] for r, ids in held.items()})
        return runtime


    def forward_backward(self, micro_batches: list, total) -> torch.Tensor:
        """The step's micro-batches, each one run of the schedule; `total()`: the step's target
        count over the data-parallel ranks (the engine's, in flight since before this call)."""
        local = torch.zeros((), device=self.device)
        for i, micro in enumerate(micro_batches):
            local += self.run(micro, total() / self.layout.data_parallel, training=True,
                              last=i == len(micro_batches) - 1)
        if self.scale_grads:  # torch's convention: the mean of the micro-batches' own means
            return local / (self.layout.microbatches * len(micro_batches))
        return local

    def whole_groups(self, names: list[list[str]]) -> list[list[str]]:
        """Each optimizer group's parameter names over every stage of the pipeline (a checkpoint's
        groups name the whole model's, so that any layout reads them): gathered over the pp group
        at the first save, kept after (the groups do not change)."""
        if self._whole is None:
            self._whole = union_names(names, self.layout.group)
        return self._whole

    def mean_loss(self, micro: dict, count: torch.Tensor) -> torch.Tensor:
        """Evaluation: the micro-batch's mean loss over its targets on the last stage, 0 elsewhere
        (every stage runs its forwards)."""
        summed = self.run(micro, torch.ones((), device=self.device), training=False)
        return summed / self.layout.pp / count.clamp(min=1)

    def _targets(self, micro: dict) -> torch.Tensor:
        """The last stage's targets: `labels`, or under topology.cp the ones its split shifted."""
        shifted = micro.get("shift_labels")
        self._shifted = shifted is not None
        return micro["labels"] if shifted is None else shifted

    def run(self, micro: dict, denominator: torch.Tensor, training: bool,
            last: bool = True) -> torch.Tensor:
        """One engine micro-batch through the pipeline; this rank's part of the step's loss (on
        the last stage its share x pp, so that the engine's mean over the world is the loss;
        elsewhere 0). `last`: the step's last micro-batch, after which FSDP stages reduce their
        gradients and reshard (torch 2.15's finalize_gradients; before it, every schedule call
        reduced: one reduce-scatter per micro-batch, where a hand-written loop makes one a step)."""
        self._denominator = denominator
        ids = micro["input_ids"]
        kwargs = {k: micro[k] for k in PASSED if micro.get(k) is not None}
        losses: list = []
        schedule = self._schedule(tuple(ids.shape), training)
        args = (ids,) if self.first else ()
        target = self._targets(micro) if self.last else None
        if training:
            deferred = {"finalize_gradients": last} if DEFERS else {}
            schedule.step(*args, target=target, losses=losses, **deferred, **kwargs)
        else:
            schedule.eval(*args, target=target, losses=losses, **kwargs)
        if not self.last:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum() * self.layout.pp


def _causal_lm_loss(last: nn.Module | None):
    """The last stage's loss: a Hugging Face model's own `loss_function`, else (a model of your own)
    transformers' causal-LM loss, the one a Llama's is (shifted, -100 ignored)."""
    if last is None:
        return None
    own = getattr(last, "loss_function", None)
    if own is not None:
        return own
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


def _probe_context(info):
    """torch 2.15's forward context: its metadata probe (a forward and a backward with grad on the
    first micro-batch, at a schedule's first step) marked, so that no expert counts its rows."""
    from parallel.engine.model.moe.experts import probing

    return probing() if info.is_metadata_inference else contextlib.nullcontext()


class _ForwardOnly(ts._PipelineScheduleRuntime):
    """torch's action runtime over forwards alone (an evaluation): its check that every stage runs
    as many backwards as forwards does not apply; the stage-to-rank map is the layout's."""

    mapping: dict[int, int]

    def _prepare_schedule_with_comms(self, actions, format: str = "compute_only") -> None:
        self.stage_index_to_group_rank = self.mapping
        for stage in self._stages:
            stage.stage_index_to_group_rank = self.mapping
        self.pipeline_order_with_comms = ts._add_send_recv(
            {r: ts._add_unshard_reshard(a) for r, a in actions.items()},
            stage_to_rank=self.mapping.__getitem__, num_stages=self._num_stages)
        wait_sends = getattr(ts, "_add_wait_send", None)  # torch 2.15's runtime retires each send
        if wait_sends is not None:  # at its own wait action ("Pipeline sends have no matching
            self.pipeline_order_with_comms = wait_sends(self.pipeline_order_with_comms)  # wait")
