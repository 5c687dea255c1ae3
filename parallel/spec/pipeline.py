"""The spec's section for topology.pp: which schedule runs the stages, over how many micro-batches, and
where a model splits. The rules hold each schedule to what torch.distributed.pipelining's constructors
accept (tests/unit/test_pipeline_spec.py)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from parallel.spec.sections import MAX_BATCH, Section

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")
ONE_STAGE = ("gpipe", "1f1b")  # one stage per rank
TWO_STAGES = ("zbv", "dualpipev")  # V-shaped: exactly two stages per rank


class Pipeline(Section):
    schedule: Annotated[
        Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"],
        Field(description="The order stages run micro-batches in (torch.distributed.pipelining). "
              "gpipe: every forward, then every backward. 1f1b (default): one forward, one backward "
              "once the pipeline is full (activations of at most pp micro-batches held). "
              "interleaved_1f1b: 1f1b over virtual_stages >= 2 stages per rank, looped (a smaller "
              "bubble). zbv and dualpipev: two stages per rank in a V, backward split into input "
              "and weight gradients to fill the bubble (docs/pipeline.md)."),
    ] = "1f1b"
    microbatches: Annotated[
        int | None,
        Field(ge=1, le=MAX_BATCH, description="Pipeline micro-batches each micro-batch "
              "(micro_batch_size rows) is cut into; it must divide micro_batch_size. Default: "
              "micro_batch_size (one row each: the smallest bubble). The step's loss and gradients "
              "do not depend on it (targets are counted over the whole step)."),
    ] = None
    virtual_stages: Annotated[
        int | None,
        Field(ge=1, le=64, description="Stages per rank: 1 for gpipe and 1f1b, 2 or more for "
              "interleaved_1f1b, 2 for zbv and dualpipev. Default: the schedule's least."),
    ] = None
    split_points: Annotated[
        list[Annotated[str, StringConstraints(min_length=1, max_length=512)]] | None,
        Field(max_length=4096, description="The decoder layers where stages 2, 3, ... begin, by "
              "module name (e.g. `model.layers.12`): pp x virtual_stages - 1 increasing names. "
              "Default: a Hugging Face family's layers split as evenly as they divide. Required "
              "for a model of your own: items of one ModuleList/ModuleDict (docs/pipeline.md)."),
    ] = None

    @property
    def stages_per_rank(self) -> int:
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 1 if self.schedule in ONE_STAGE else 2


def pipeline_problems(spec) -> list[tuple[str, str]]:
    """The pipeline section against topology.pp and micro_batch_size."""
    p, pp, micro_batch_size = spec.pipeline, spec.topology.pp, spec.micro_batch_size
    if pp == 1:  # a dumped spec writes every field: only what differs from the default is read
        changed = sorted(k for k, v in p if v != Pipeline.model_fields[k].default)
        return [("pipeline", f"{changed} set, but topology.pp is 1: nothing is pipelined; set "
                 "topology.pp > 1 or remove them")] if changed else []
    out, v = [], p.stages_per_rank
    if spec.loss_weighting != "tokens":
        out.append(("loss_weighting", f"{spec.loss_weighting!r} with topology.pp {pp}: the last "
                    "stage weighs each micro-batch by its targets over the step's (the tokens "
                    "rule); use loss_weighting: tokens"))
    if p.schedule in ONE_STAGE and v != 1:
        out.append(("pipeline.virtual_stages", f"{v} with schedule {p.schedule!r}, which runs one "
                    "stage per rank; use 1, or schedule: interleaved_1f1b"))
    if p.schedule == "interleaved_1f1b" and v < 2:
        out.append(("pipeline.virtual_stages", f"{v} with interleaved_1f1b: it interleaves 2 or "
                    "more stages per rank; use 2, or schedule: 1f1b"))
    if p.schedule in TWO_STAGES and v != 2:
        out.append(("pipeline.virtual_stages", f"{v} with {p.schedule}: its V holds exactly 2 "
                    "stages per rank; use 2"))
    n = p.microbatches or micro_batch_size
    if micro_batch_size % n:
        out.append(("pipeline.microbatches", f"{n} does not divide micro_batch_size "
                    f"{micro_batch_size}; pick a divisor of it"))
    least = pp * (2 if p.schedule == "dualpipev" else 1)
    if n < least:
        out.append(("pipeline.microbatches", f"{n} pipeline micro-batches for {p.schedule} at pp "
                    f"{pp}: it needs at least {least} (the stages of one pipeline); raise "
                    "micro_batch_size or pipeline.microbatches"))
    rounds = max(1, n // pp)
    if p.schedule == "interleaved_1f1b" and n % rounds:
        out.append(("pipeline.microbatches", f"{n} is not a multiple of its rounds ({rounds} = "
                    f"{n} // pp {pp}), as interleaved_1f1b needs; use a multiple of pp"))
    return out
