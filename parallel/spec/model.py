"""The training-strategy spec: one document, validated once, meaning the same on every backend.

Neutral fields (`shard`, `offload`, `precision`, ...) are defined by what they do, not by any backend's
vocabulary; each backend's adapter translates them. This class holds them and the spec's own rules.
The registry (parallel/registry.py) assembles the class specs are validated with: this one, plus each
backend's own section (`fsdp:`, `deepspeed:`, `xla:`, declared by its descriptor), plus the lookup of
the backends' rules (`backends`). Validation is one layer for every entry point (load_spec, validate,
explain, plan, bench, parity, create_engine): the spec's own rules, then the backend's, from its
descriptor: what it cannot honour (its capabilities, with the nearest valid choice), the parallel
dimensions it does not implement, and whatever its translation refuses. Nothing here imports the
registry or a backend. No environment variables are read in this module: launch-time facts come from
`parallel.launch`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Protocol

from pydantic import Field, field_validator, model_validator

from parallel.spec.compiling import Compile, device_problems
from parallel.spec.dims import HYBRID, ParallelDims, batch_problems, world_problems
from parallel.spec.errors import SpecError, rule_error
from parallel.spec.pipeline import Pipeline, pipeline_problems
from parallel.spec.precision import Float8, LossScale, precision_problems
from parallel.spec.sections import MAX_BATCH, Checkpointing, MoE, Section, Topology, Wrap
from parallel.spec.sequence import Sequence
from parallel.spec.tracking import Tracking

Shard = Literal["full", "grad_op", "optimizer", "none", "hybrid", "hybrid_grad_op"]


class Backends(Protocol):
    """What the spec asks of the registry: a backend's descriptor by name (SpecError naming the
    choices when there is none)."""

    def get(self, name: str) -> Any: ...


class Spec(Section):
    # Set on the class the registry assembles (with every backend's section): where a backend's
    # rules are looked up, and the names of the backends' sections. This class alone validates no
    # backend: build specs with parallel.load_spec or parallel.Spec.
    backends: ClassVar[Backends | None] = None
    sections: ClassVar[tuple[str, ...]] = ()

    backend: Annotated[
        str,
        Field(description="Which engine runs the job: torch FSDP (fsdp), DeepSpeed ZeRO (deepspeed) "
              "or PyTorch/XLA FSDP (xla_fsdp); any backend parallel/registry.py lists."),
    ] = "fsdp"
    shard: Annotated[
        Shard,
        Field(
            description="What is partitioned across ranks. full: parameters, gradients and optimizer "
            "state (FULL_SHARD, ZeRO-3). grad_op: gradients and optimizer state, parameters kept "
            "whole between forward and backward (SHARD_GRAD_OP, ZeRO-2). optimizer: optimizer state "
            "only (ZeRO-1). none: replicate everything (DDP, NO_SHARD, ZeRO-0). hybrid / "
            "hybrid_grad_op: full / grad_op inside each shard group, replicated across groups "
            "(HYBRID_SHARD, HYBRID_SHARD_ZERO2, ZeRO++ hpZ)."
        ),
    ] = "full"
    offload: Annotated[
        Literal["none", "optimizer", "params"],
        Field(description="What lives in CPU memory between uses. optimizer: optimizer state and its "
              "step. params: parameters and gradients too (implies optimizer)."),
    ] = "none"
    precision: Annotated[
        Literal["fp32", "bf16", "fp16", "fp8"],
        Field(description="Compute dtype. bf16/fp16 are mixed precision: forward and backward run "
              "in the low dtype, while master parameters, gradient reduction and optimizer state "
              "stay fp32. fp16 adds dynamic loss scaling (see loss_scale). fp8: the linear layers' "
              "matmuls in float8 (torchao), the rest in float8.base (bf16 by default)."),
    ] = "fp32"
    float8: Annotated[Float8, Field(description="precision: fp8's recipe, the layers it leaves "
                                    "in high precision, float8 all-gather.")] = Float8()
    reduce_dtype: Annotated[
        Literal["fp32", "compute", "bf16", "fp16"],
        Field(description="Dtype gradients are reduced in across ranks. fp32 (default): exact sums "
              "on every backend. compute: the compute dtype of `precision` (DeepSpeed's own default, "
              "half the bytes with bf16/fp16). bf16 / fp16: that dtype whatever the compute dtype."),
    ] = "fp32"
    pin_memory: Annotated[
        bool,
        Field(description="With offload: keep the CPU copies in page-locked memory, for faster "
              "copies to and from the GPU (DeepSpeed's and FSDP2's default). No effect on a "
              "CPU-only host."),
    ] = True
    loss_scale: Annotated[
        LossScale, Field(description="Dynamic loss scaling knobs; read only with precision: fp16.")
    ] = LossScale()
    activation_checkpointing: Annotated[
        bool,
        Field(description="Recompute each wrapped unit's activations in backward instead of storing "
              "them (non-reentrant checkpoint on every unit the wrap policy selects)."),
    ] = False
    wrap: Annotated[Wrap, Field(description="Which modules become shard units.")] = Wrap()
    sequence: Annotated[Sequence, Field(description="Long rows: a tiled loss, activations "
                                        "offloaded to host memory.")] = Sequence()
    moe: Annotated[MoE, Field(description="Mixture-of-experts models: the router's loss.")] = MoE()
    pipeline: Annotated[Pipeline, Field(description="topology.pp's schedule, micro-batches and "
                                        "stage boundaries (docs/pipeline.md).")] = Pipeline()
    compile: Annotated[
        Compile, Field(description="torch.compile: what is compiled and how (`compile: true` for "
                       "the defaults).")
    ] = Compile()
    micro_batch_size: Annotated[
        int, Field(ge=1, le=MAX_BATCH, description="Samples per rank per forward pass.")
    ] = 1
    grad_accum_steps: Annotated[
        int,
        Field(ge=1, le=MAX_BATCH,
              description="Micro-batches per optimizer step. A step's batch on each rank holds "
              "micro_batch_size * grad_accum_steps samples; how their losses combine: loss_weighting."),
    ] = 1
    loss_weighting: Annotated[
        Literal["tokens", "micro_batches"],
        Field(description="How micro-batches and ranks combine into the step's loss. tokens "
              "(default): each micro-batch weighs by the items its loss averages over (target "
              "tokens: labels != -100, after the shift for causal LMs), so the step's loss and "
              "gradient are those of one process on the global batch whatever the world size and "
              "accumulation, padded rows included (Hugging Face Trainer's num_items_in_batch). "
              "Models whose loss is not a known token mean (classification heads, a loss_fn "
              "without count_fn) weigh every micro-batch alike, exact for per-sample means. "
              "micro_batches: every micro-batch's own mean weighs alike (Accelerate's and "
              "Lightning's behaviour; differs when rows hold different numbers of targets)."),
    ] = "tokens"
    global_batch_size: Annotated[
        int | None,
        Field(ge=1, le=1 << 50, description="Samples per optimizer step over all data-parallel ranks "
              "(DeepSpeed's train_batch_size). Optional: when set, micro_batch_size x "
              "grad_accum_steps x the data-parallel size must equal it, so a launch at another "
              "world size fails instead of silently changing the batch."),
    ] = None
    grad_clip: Annotated[
        float | None,
        Field(gt=0, description="Clip the global gradient 2-norm to this value. Off when unset "
              "(DeepSpeed's hidden default of 1.0 is overridden explicitly)."),
    ] = None
    seed: Annotated[int, Field(ge=0, le=2**32 - 1, description="Seeds torch, numpy and random on "
                               "every rank (numpy takes 0 <= seed < 2**32).")] = 0
    state_dict: Annotated[
        Literal["sharded", "full"],
        Field(description="How `save` writes model and optimizer state: sharded (each rank writes "
              "its shards; fast, reshardable) or full (consolidated on rank 0)."),
    ] = "sharded"
    checkpoint: Annotated[
        Checkpointing, Field(description="Checkpoint retention (every backend writes one format).")
    ] = Checkpointing()
    on_nonfinite: Annotated[
        Literal["raise_deferred", "raise", "skip"],
        Field(description="A step whose loss is NaN or inf on any rank. raise_deferred (default): "
              "detected on the device with no host read; NonFiniteLossError at the next step, save "
              "or close once the device's record reaches the host, and no checkpoint is written "
              "after it (that step's update has happened). raise: an error naming the step and the "
              "ranks before the update. skip: no update, parameters and optimizer state untouched. "
              "raise and skip read the loss to the host once per step (docs/reliability.md)."),
    ] = "raise_deferred"
    timeout_s: Annotated[
        float, Field(gt=0, le=7 * 86400,
                     description="Collective timeout in seconds: a stalled rank fails the "
                     "job after this long instead of hanging.")
    ] = 600.0
    topology: Annotated[Topology, Field(description="Hosts and processes.")] = Topology()
    tracking: Annotated[
        Tracking, Field(description="Experiment tracking: TensorBoard, MLflow, wandb, JSON lines.")
    ] = Tracking()

    world_size = property(lambda self: self.topology.world_size)

    @property
    def dims(self) -> ParallelDims:
        """Every parallel dimension (parallel/spec/dims.py): ask it for data-parallel facts."""
        return ParallelDims.from_spec(self)

    @classmethod
    def descriptor(cls, name: str):
        """The backend's descriptor, from the registry this class was assembled with."""
        if cls.backends is None:
            raise TypeError("parallel.spec.model.Spec holds the spec's own fields; the registry "
                            "assembles it with the backends' sections and rules: build specs with "
                            "parallel.load_spec(...) or parallel.Spec(...)")
        return cls.backends.get(name)

    @property
    def spmd(self) -> bool:
        """One process drives a host's devices (known at run time): its mesh holds tp and cp."""
        return self.descriptor(self.backend).launch.process_devices(self) is None

    # tensor- and context-parallel ranks that are processes (SPMD: its mesh's model / seq axes)
    process_tp = property(lambda self: 1 if self.spmd else self.topology.tp)
    process_cp = property(lambda self: 1 if self.spmd else self.topology.cp)

    @property
    def shard_group_size(self) -> int:
        """Ranks that shard one copy of the model (every data-parallel rank unless hybrid), times
        cp: a cp group's ranks hold other tokens of the same rows and shard and reduce together
        (FSDP2 over dp_shard x cp, DeepSpeed's data-parallel group)."""
        dims = self.dims  # the default group (procs_per_node) is decided there, once
        return (dims.dp_shard if self.shard in HYBRID else dims.dp_size) * dims.cp

    @property
    def compute(self) -> str:
        """fp32, bf16 or fp16: the dtype outside float8's matmuls (float8.base with fp8)."""
        return self.float8.base if self.precision == "fp8" else self.precision

    @property
    def grad_reduce_dtype(self) -> str:
        """fp32, bf16 or fp16: what `reduce_dtype` means with this `precision`."""
        return self.compute if self.reduce_dtype == "compute" else self.reduce_dtype

    @property
    def checkpoint_activations(self) -> bool:
        """activation_checkpointing, or a backend section's own spelling of it (XLA's
        `xla.xla_fsdp_grad_ckpt`: either spelling)."""
        return self.activation_checkpointing or any(
            bool(value) for value, _ in self._spelled("activation_checkpointing"))

    def _spelled(self, field: str) -> list[tuple[object, str]]:
        """(value, path) of each backend section that sets neutral `field` in its own words."""
        found = (getattr(self, name).neutral().get(field) for name in self.sections)
        return [f for f in found if f is not None]

    @field_validator("backend")
    @classmethod
    def _registered(cls, value: str) -> str:
        try:
            cls.descriptor(value)
        except SpecError as err:
            raise rule_error(*err.problems) from None
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> Spec:
        problems = []
        group = self.topology.shard_group_size
        if group is not None and self.shard not in HYBRID:
            problems.append(("topology.shard_group_size", f"is only read with a hybrid shard, not "
                             f"shard: {self.shard!r}; remove it or use shard: hybrid"))
        # data-parallel ranks (dims floors a bad group)
        dp = self.world_size // (self.process_tp * self.process_cp * self.topology.pp)
        if self.shard in HYBRID and dp % self.dims.dp_shard:
            problems.append(("topology.shard_group_size", f"{self.dims.dp_shard} does not divide "
                             f"the data-parallel size {dp} (world size / (tp x cp x pp)); pick a "
                             "divisor of it"))
        problems += precision_problems(self) + batch_problems(self) + pipeline_problems(self)
        problems += device_problems(self)
        if self.sequence.loss_tile is not None and self.topology.tp > 1:
            problems.append(("sequence.loss_tile", f"{self.sequence.loss_tile} with topology.tp "
                             f"{self.topology.tp}: a tensor-parallel lm_head splits the vocabulary, "
                             "which the tiled loss does not reduce over; unset one of them"))
        for value, path in self._spelled("activation_checkpointing"):
            if ("activation_checkpointing" in self.model_fields_set
                    and value != self.activation_checkpointing):
                problems.append((path, f"{value} contradicts activation_checkpointing: "
                                 f"{self.activation_checkpointing}; they mean the same thing, keep "
                                 "one"))
        if problems:
            raise rule_error(*problems)
        return self

    @model_validator(mode="after")
    def _backend_rules(self) -> Spec:
        """The backend's own rules, after the spec's: what it cannot honour (its capabilities) and
        what its translation refuses (a native key contradicting the spec, a combination it has no
        mode for)."""
        descriptor = self.descriptor(self.backend)
        t, d = self.topology, self.dims
        # as written (under SPMD, dims holds the processes' share of tp: 1)
        problems = ParallelDims(d.dp_replicate, d.dp_shard, tp=t.tp, cp=t.cp, pp=t.pp,
                                ep=t.ep).problems(descriptor)
        if t.tp == 1 and t.tp_plan is not None:
            problems.append(("topology.tp_plan", "is set but topology.tp is 1, so nothing is "
                             "split; set tp > 1 or remove tp_plan"))
        if not problems:  # SPMD: the runtime checks its devices
            problems += world_problems(self.world_size, self.process_tp * self.process_cp * t.pp, t)
        for name in descriptor.capabilities.unsupported:  # every field the backend names
            value = self
            for part in name.split("."):
                value = getattr(value, part)
            bad = descriptor.capabilities.check(name, value)
            if bad:
                problems.append((name, f"{value!r} is not supported by backend "
                                       f"{self.backend!r}: {bad.reason}; use {bad.nearest}"))
        if problems:
            raise rule_error(*problems)
        try:
            descriptor.translate(self)
        except SpecError as err:
            raise rule_error(*err.problems) from None
        return self
