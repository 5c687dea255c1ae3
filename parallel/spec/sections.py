"""Sub-sections of the spec every backend reads: topology, checkpoint retention, wrapping, MoE. Precision's
(loss scaling, float8) are precision.py's.
Each backend's own section lives in its package (backends/<name>/options.py) and is added to the spec
by the registry from the backend's descriptor.

Every field is documented where it is declared; the descriptions feed `polyshard schema` and the README's
spec reference.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from parallel.spec.errors import rule_error


# Upper bounds of the layout (hostile numbers are refused naming the field, never reach a mesh):
# 1M ranks, as the checkpoint format's MAX_WRITERS.
MAX_WORLD = 1 << 20
MAX_NODES = 1 << 16
MAX_PER_NODE = 1 << 10
MAX_BATCH = 1 << 24  # samples per micro-batch, micro-batches per step


class Section(BaseModel):
    # inf / nan are refused in every float field (pydantic accepts them by default: a timeout of
    # inf or a clip of nan would pass validation and fail, or hang, inside a step)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def neutral(self) -> dict[str, tuple[object, str]]:
        """A backend section's own spelling of a neutral field: {neutral field: (value, this
        field's path)} for what is set here (XLA's xla_fsdp_grad_ckpt is activation
        checkpointing). The spec reads both spellings and refuses a contradiction."""
        return {}


class Topology(Section):
    nodes: Annotated[int, Field(ge=1, le=MAX_NODES, description="Number of hosts (torchrun "
                                "--nnodes).")] = 1
    procs_per_node: Annotated[
        int,
        Field(ge=1, le=MAX_PER_NODE, description="Processes per host: one per GPU (or TPU chip under "
              "TorchTPU); on CPU, one per rank you want."),
    ] = 1
    shard_group_size: Annotated[
        int | None,
        Field(
            ge=1, le=MAX_WORLD,
            description="Hybrid sharding only: ranks in one shard group; groups replicate each other. "
            "Default: procs_per_node (shard inside a host, replicate across hosts).",
        ),
    ] = None
    tp: Annotated[
        int,
        Field(ge=1, le=MAX_WORLD, description="Tensor-parallel degree N: a Megatron column/row split of the "
              "attention and MLP projections over N ranks, as `tp_plan` (or the model's own tp "
              "plan) says; embeddings, norms and what the plan leaves out stay whole. TP is the "
              "innermost mesh dimension (N consecutive ranks, one host), every rank of a TP group "
              "takes the same micro-batch, and data-parallel ranks = world size / N. Backends that "
              "cannot split refuse N > 1 naming why (docs/tp.md)."),
    ] = 1
    cp: Annotated[
        int,
        Field(ge=1, le=MAX_WORLD,
              description="Context-parallel degree N: each row's tokens split over N ranks "
              "(every rank of a cp group is fed the same rows; polyshard keeps 1/N of each row "
              "on each, labels shifted first) and attention run over whole rows with 1/N of the "
              "heads (Ulysses: an all-to-all before and after the model's own attention). Inside "
              "tp, outside data parallelism; gradients average over dp x cp. FSDP2 and DeepSpeed "
              "run it; FSDP1 and XLA refuse N > 1 naming why; N must divide each rank's query and "
              "key/value heads (checked at prepare; docs/long-sequences.md)."),
    ] = 1
    pp: Annotated[
        int,
        Field(ge=1, le=MAX_WORLD,
              description="Pipeline-parallel degree N: a Hugging Face decoder's layers split into "
              "N stages (x pipeline.virtual_stages) over ranks, the outermost mesh dimension; "
              "each stage keeps the model's parameter names, and a step's loss and gradients are "
              "one process's on the global batch. FSDP2 runs it (torch.distributed.pipelining, "
              "`pipeline:` picks the schedule), DeepSpeed at ZeRO-0 in fp32 (its pipeline "
              "engine, 1f1b); FSDP1 and XLA refuse N > 1 naming why (docs/pipeline.md)."),
    ] = 1
    ep: Annotated[
        int,
        Field(ge=1, le=MAX_WORLD,
              description="Expert-parallel degree N: each mixture-of-experts block's experts split "
              "over N ranks borrowed from data and context parallelism (N divides dp_shard x "
              "cp), tokens sent to their experts' owners and back by all-to-all; each expert is "
              "sharded over the ranks holding the same ones. The router, top-k, shared experts "
              "and balancing loss are the model's own, no token dropped: a step is one "
              "process's. FSDP2 runs it for Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE and "
              "DeepSeek-V3 blocks, with tp, cp, pp and hybrid sharding (each tp and pipeline "
              "rank's data-parallel ranks make its ep groups); FSDP1, DeepSpeed and XLA refuse "
              "N > 1 naming why "
              "(docs/moe.md)."),
    ] = 1
    tp_plan: Annotated[
        dict[Annotated[str, StringConstraints(min_length=1, max_length=512)],
             Literal["colwise", "rowwise", "colwise_rep"]] | None,
        Field(max_length=4096, description="With tp > 1 (at most 4,096 entries of 512 "
              "characters: a plan names module patterns, not every module): {module path "
              "(fnmatch, from the model's root, e.g. "
              "`model.layers.*.mlp.up_proj`): style}; colwise splits a Linear's outputs, rowwise "
              "its inputs (then sums over the TP group), colwise_rep splits outputs and gathers "
              "them whole (an LM head). Unset: the model's own plan (Hugging Face's "
              "`base_model_tp_plan` and the head class's `_tp_plan`)."),
    ] = None
    device: Annotated[
        Literal["auto", "cuda", "tpu", "cpu"],
        Field(description="The device each rank trains on. auto: torch.accelerator's (a CUDA GPU, "
              "or a TPU where TorchTPU, `torch-tpu`, is installed), else the CPU. cuda / tpu: that "
              "device, refused at prepare naming what installs it where this host lacks it. tpu "
              "is TorchTPU's device (torch 2.11-2.15, `polyshard[torchtpu]`) on FSDP2, through "
              "the same code as CUDA (process group tpu_dist, DeviceMesh('tpu')); backend xla_fsdp "
              "runs TPUs through torch_xla instead (PJRT_DEVICE). docs/tpu.md."),
    ] = "auto"
    rdzv_endpoint: Annotated[
        str | None,
        Field(pattern=r"^[^:\s]+:\d+$", description="HOST:PORT every node of a multi-node job "
              "meets at (torchrun --rdzv-endpoint; accelerate's main_process_ip:main_process_port). "
              "`polyshard launch --rdzv-endpoint` overrides it."),
    ] = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @model_validator(mode="after")
    def _bounded_world(self) -> Topology:
        if self.world_size > MAX_WORLD:
            raise rule_error(("topology.nodes", f"{self.nodes} nodes x {self.procs_per_node} "
                              f"procs_per_node = {self.world_size:,} ranks, more than the "
                              f"{MAX_WORLD:,} polyshard lays out; nearest valid: nodes "
                              f"{MAX_WORLD // self.procs_per_node:,}"))
        return self


class Checkpointing(Section):
    dir: Annotated[
        str | None,
        Field(description="Where `engine.maybe_save()` writes step-NNNNNNNN checkpoints and `latest`; "
              "what `resume: auto` reads."),
    ] = None
    every: Annotated[
        int | None, Field(ge=1, description="`engine.maybe_save()` saves when this divides the step.")
    ] = None
    resume: Annotated[
        Literal["never", "auto", "latest_valid"],
        Field(description="auto: `engine.resume()` loads `dir`'s latest complete checkpoint when one "
              "exists (after a crash or an elastic restart), else starts fresh, saying which; a "
              "damaged `latest` stops the job naming the newest intact checkpoint. latest_valid: "
              "the same, but a damaged `latest` falls back to the newest intact checkpoint by "
              "itself, said loudly. never: it does not."),
    ] = "never"
    keep_last: Annotated[
        int | None,
        Field(ge=1, description="After each save, delete all but the newest `keep_last` checkpoints "
              "next to it (directories step-N with a polyshard manifest of step N, ordered by the N "
              "of their names; nothing else is touched). Unset keeps all."),
    ] = None

    preemption_signals: Annotated[
        list[Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP"]],
        Field(description="Signals that mean 'you are being preempted' (Slurm's --signal, "
              "Kubernetes' and spot VMs' SIGTERM). With `dir` set, any rank catching one makes every "
              "rank save a complete checkpoint into `dir` at an agreed step boundary and exit with "
              "code 85 (requeue). Nothing is saved inside the handler. [] leaves signals alone."),
    ] = ["SIGTERM", "SIGUSR1"]
    preemption_grace_s: Annotated[
        float,
        Field(gt=0, le=65535,
              description="Seconds between the scheduler's signal and its kill: what `polyshard "
              "launch --emit` asks for (Slurm `--signal=B:USR1@N`, Kubernetes "
              "terminationGracePeriodSeconds). Leave room for a few steps and one save."),
    ] = 120.0
    async_save: Annotated[
        bool,
        Field(description="`save` returns once this rank's state is copied to host memory (as large "
              "as what the rank holds); a background writer (async_writer) writes, hashes and "
              "publishes it, and `latest` moves only when every rank's files are durable. The "
              "next save, load and close wait for it and raise its error. The host copy is kept "
              "from one save to the next (page-locked on GPUs) and freed at close "
              "(docs/checkpoint-format.md)."),
    ] = False

    async_writer: Annotated[
        Literal["process", "thread"],
        Field(description="Where an async save is written. process: a process of each rank's own, "
              "started at the first async save, which maps the rank's staging memory (nothing "
              "copied twice) and shares nothing of the training process's interpreter; thread: "
              "a thread of the training process (no extra process; its serialisation and hashing "
              "hold the interpreter lock in slices the steps then wait for). torch's "
              "AsyncCheckpointerType; measured costs in docs/checkpoint-format.md."),
    ] = "process"
    write_threads: Annotated[
        int,
        Field(ge=1, le=64, description="Threads each rank writes its state files with (torch DCP's "
              "FileSystemWriter thread_count, whose own default is 1); each file is hashed as it is "
              "written (docs/checkpoint-format.md has the measured bandwidth per count)."),
    ] = 1
    hf_at_end: Annotated[
        bool,
        Field(description="`engine.close()` after a job that trained writes the model in Hugging "
              "Face format into `dir`/hf-step-NNNNNNNN (what `engine.save_pretrained` writes: "
              "sharded safetensors, index, config.json; a LoRA run's adapter), every rank its "
              "share of the files, fsynced and renamed into place; torchtitan's last_save_in_hf. "
              "A directory of that name already there (a resumed job that trained no further) is "
              "kept."),
    ] = False

    @model_validator(mode="after")
    def _needs_dir(self) -> Checkpointing:
        if self.dir is None and (self.every is not None or self.resume != "never"
                                 or self.hf_at_end):
            asker = "hf_at_end" if self.hf_at_end else f"every / resume: {self.resume}"
            raise rule_error(("checkpoint.dir", f"is required by checkpoint.{asker}; "
                              "set it to a directory such as runs/job/ckpt"))
        return self


class Wrap(Section):
    policy: Annotated[
        Literal["auto", "layer_classes", "size", "none"],
        Field(
            description="Which modules become their own shard unit: `auto` uses the model's "
            "`_no_split_modules` (Hugging Face models list their decoder layer there); `layer_classes` "
            "the class names in `layer_classes`; `size` every module holding >= `min_num_params` "
            "parameters not already wrapped below it; `none` only the root."
        ),
    ] = "auto"
    layer_classes: Annotated[
        list[str],
        Field(description="Class names to wrap, e.g. [LlamaDecoderLayer] (policy: layer_classes)."),
    ] = []
    min_num_params: Annotated[
        int | None, Field(ge=1, description="Parameter threshold for policy: size.")
    ] = None

    @model_validator(mode="after")
    def _policy_fields(self) -> Wrap:
        if self.policy == "layer_classes" and not self.layer_classes:
            raise rule_error(
                ("wrap.layer_classes", "policy 'layer_classes' needs at least one class name; "
                 "add e.g. `layer_classes: [LlamaDecoderLayer]` or use `policy: auto`")
            )
        if self.policy == "size" and self.min_num_params is None:
            raise rule_error(
                ("wrap.min_num_params", "policy 'size' needs a threshold; add e.g. "
                 "`min_num_params: 1000000`")
            )
        if self.policy != "layer_classes" and self.layer_classes:
            raise rule_error(("wrap.layer_classes", f"is only read with policy 'layer_classes', "
                              f"not {self.policy!r}; set `policy: layer_classes` or remove it"))
        if self.policy != "size" and self.min_num_params is not None:
            raise rule_error(("wrap.min_num_params", f"is only read with policy 'size', not "
                              f"{self.policy!r}; set `policy: size` or remove it"))
        return self


class MoE(Section):
    router_loss: Annotated[
        Literal["global", "rank"],
        Field(description="Which tokens a mixture-of-experts model's load-balancing loss "
              "(Hugging Face's `output_router_logits: true`, its router_aux_loss_coef) is computed "
              "over. global (default): a micro-batch's tokens on every data-parallel (x cp) rank: "
              "the per-expert token counts and router probabilities are summed over those ranks "
              "before their product (Megatron's global_aux_loss, Qwen's global-batch balancing), "
              "so at grad_accum_steps 1 the loss and gradients are one process's on the global "
              "batch; at grad_accum_steps N they are the mean of each micro-batch's global loss (the "
              "counts of a whole step are known only after its last forward). rank: each rank's "
              "own tokens, as Hugging Face's model computes it run per device (Accelerate, "
              "Trainer): a mean of per-rank losses, which no single process computes "
              "(docs/moe.md)."),
    ] = "global"
