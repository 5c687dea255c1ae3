"""Sub-sections of the spec: topology, wrapping, loss scaling, and one section per backend.

Every field is documented where it is declared; the descriptions feed `polyshard schema` and the README's
spec reference. Backend sections hold only knobs that exist on that backend; anything else goes through
the section's `native:` passthrough, which the backend merges last and checks against the spec.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def rule_error(*problems: tuple[str, str]) -> PydanticCustomError:
    """One validation error carrying `(field path, message)` pairs; `parallel.spec.io` expands them."""
    text = "; ".join(f"{p}: {m}" for p, m in problems)
    return PydanticCustomError("spec_rule", "{text}", {"text": text, "problems": list(problems)})


class Topology(Section):
    nodes: Annotated[int, Field(ge=1, description="Number of hosts (torchrun --nnodes).")] = 1
    procs_per_node: Annotated[
        int,
        Field(ge=1, description="Processes per host: one per GPU; on CPU, one per rank you want."),
    ] = 1
    shard_group_size: Annotated[
        int | None,
        Field(
            ge=1,
            description="Hybrid sharding only: ranks in one shard group; groups replicate each other. "
            "Default: procs_per_node (shard inside a host, replicate across hosts).",
        ),
    ] = None
    tp: Annotated[
        int,
        Field(ge=1, description="Tensor-parallel degree N: a Megatron column/row split of the "
              "attention and MLP projections over N ranks, as `tp_plan` (or the model's own tp "
              "plan) says; embeddings, norms and what the plan leaves out stay whole. TP is the "
              "innermost mesh dimension (N consecutive ranks, one host), every rank of a TP group "
              "takes the same micro-batch, and data-parallel ranks = world size / N. Backends that "
              "cannot split refuse N > 1 naming why (docs/tp.md)."),
    ] = 1
    tp_plan: Annotated[
        dict[str, Literal["colwise", "rowwise", "colwise_rep"]] | None,
        Field(description="With tp > 1: {module path (fnmatch, from the model's root, e.g. "
              "`model.layers.*.mlp.up_proj`): style}; colwise splits a Linear's outputs, rowwise "
              "its inputs (then sums over the TP group), colwise_rep splits outputs and gathers "
              "them whole (an LM head). Unset: the model's own plan (Hugging Face's "
              "`base_model_tp_plan` and the head class's `_tp_plan`)."),
    ] = None
    rdzv_endpoint: Annotated[
        str | None,
        Field(pattern=r"^[^:\s]+:\d+$", description="HOST:PORT every node of a multi-node job "
              "meets at (torchrun --rdzv-endpoint; accelerate's main_process_ip:main_process_port). "
              "`polyshard launch --rdzv-endpoint` overrides it."),
    ] = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


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
        Literal["never", "auto"],
        Field(description="auto: `engine.resume()` loads `dir`'s latest complete checkpoint when one "
              "exists (after a crash or an elastic restart), else starts fresh. never: it does not."),
    ] = "never"
    keep_last: Annotated[
        int | None,
        Field(ge=1, description="After each save, delete all but the newest `keep_last` checkpoints "
              "next to it (directories with a polyshard manifest, ordered by step). Unset keeps all."),
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
        Field(gt=0, le=65535, description="Seconds between the scheduler's signal and its kill: what `polyshard "
              "launch --emit` asks for (Slurm `--signal=B:USR1@N`, Kubernetes "
              "terminationGracePeriodSeconds). Leave room for a few steps and one save."),
    ] = 120.0
    async_save: Annotated[
        bool,
        Field(description="`save` returns once this rank's state is copied to host memory (as large "
              "as what the rank holds); a background thread writes, hashes and publishes it, and "
              "`latest` moves only when every rank's files are durable. The next save, load and "
              "close wait for it and raise its error. Costs one host copy of the rank's state "
              "while writing; on GPUs that copy is page-locked memory kept from one save to the "
              "next and freed at close (docs/checkpoint-format.md)."),
    ] = False

    @model_validator(mode="after")
    def _needs_dir(self) -> Checkpointing:
        if self.dir is None and (self.every is not None or self.resume == "auto"):
            raise rule_error(("checkpoint.dir", "is required by checkpoint.every / resume: auto; "
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


class LossScale(Section):
    """Dynamic loss scaling for `precision: fp16` (FSDP's ShardedGradScaler, DeepSpeed's fp16 block)."""

    initial_scale_power: Annotated[
        int, Field(ge=0, le=32, description="Start at 2**initial_scale_power.")
    ] = 16
    growth_interval: Annotated[
        int, Field(ge=1, description="Steps without overflow before the scale doubles.")
    ] = 1000
    hysteresis: Annotated[
        int, Field(ge=1, description="Overflows tolerated before the scale halves (DeepSpeed).")
    ] = 2
    min_scale: Annotated[float, Field(gt=0, description="The scale never drops below this.")] = 1.0


class FsdpOptions(Section):
    version: Annotated[
        Literal[1, 2],
        Field(description="2: per-parameter `fully_shard` (DTensor). 1: FullyShardedDataParallel "
              "with flat parameters."),
    ] = 2
    backward_prefetch: Annotated[
        Literal["backward_pre", "backward_post", "none"],
        Field(description="When to all-gather the next unit's parameters in backward. FSDP2 always "
              "prefetches before the current unit's gradient computation (backward_pre)."),
    ] = "backward_pre"
    forward_prefetch: Annotated[
        bool, Field(description="All-gather the next unit's parameters before the current forward.")
    ] = False
    sync_module_states: Annotated[
        bool, Field(description="Broadcast rank 0's parameters and buffers before sharding, so "
                    "every rank starts from the same weights.")
    ] = True
    cpu_ram_efficient_loading: Annotated[
        bool, Field(description="Only rank 0 materialises the model (pass a model factory to "
                    "`prepare`); other ranks build it on the meta device and receive rank 0's "
                    "weights. Needs sync_module_states.")
    ] = False
    use_orig_params: Annotated[
        bool, Field(description="FSDP1: expose original parameters (needed for per-parameter "
                    "optimizer groups and torch.compile). FSDP2 always does.")
    ] = True
    limit_all_gathers: Annotated[
        bool, Field(description="FSDP1: rate-limit all-gathers to bound memory.")
    ] = True
    reshard_output: Annotated[
        bool, Field(description="FSDP2: also reshard the output unit (final norm and output layer, "
                    "or tied embeddings) after forward. Off (torchtitan's default): backward needs "
                    "it first, so it stays gathered from its forward to its backward; on: saves "
                    "its unsharded size in that gap (Llama-3-8B: 525M parameters, 1 GiB in bf16) "
                    "for one more all-gather of it per step (torchtitan's "
                    "reshard_after_forward_policy: always).")
    ] = False
    native: Annotated[
        dict[str, Any],
        Field(description="Keyword arguments passed to fully_shard (v2) or FullyShardedDataParallel "
              "(v1), merged last; a key that contradicts the spec is an error."),
    ] = {}

    @model_validator(mode="after")
    def _version_rules(self) -> FsdpOptions:
        if self.cpu_ram_efficient_loading and not self.sync_module_states:
            raise rule_error(("fsdp.sync_module_states", "must be true when "
                              "cpu_ram_efficient_loading is true (other ranks start empty and "
                              "receive rank 0's weights); set `sync_module_states: true`"))
        if self.version == 2 and not self.use_orig_params:
            raise rule_error(("fsdp.use_orig_params", "false is an FSDP1 option: FSDP2 always keeps "
                              "original parameters; remove it or set `fsdp.version: 1`"))
        if self.version == 1 and self.reshard_output:
            raise rule_error(("fsdp.reshard_output", "is an FSDP2 option (FSDP1 reshards by "
                              "sharding strategy); remove it or set `fsdp.version: 2`"))
        if self.version == 2 and self.backward_prefetch != "backward_pre":
            raise rule_error(("fsdp.backward_prefetch", f"{self.backward_prefetch!r} needs FSDP1: "
                              "FSDP2 always prefetches backward_pre; use `backward_prefetch: "
                              "backward_pre` or `fsdp.version: 1`"))
        return self


class DeepSpeedOptions(Section):
    zero_init: Annotated[
        bool, Field(description="ZeRO-3: construct the model inside deepspeed.zero.Init (pass a "
                    "model factory) so no rank ever holds all parameters; the analogue of "
                    "cpu_ram_efficient_loading.")
    ] = False
    gather_16bit_weights_on_model_save: Annotated[
        bool, Field(description="ZeRO-3: gather full weights when saving "
                    "(stage3_gather_16bit_weights_on_model_save).")
    ] = True
    cpu_adam: Annotated[
        bool, Field(description="With offload, replace a client Adam/AdamW by DeepSpeed's compiled "
                    "CPU Adam (faster; compiled on first use). Off keeps the client optimizer.")
    ] = False
    offload_device: Annotated[
        Literal["cpu", "nvme"],
        Field(description="Where `offload` puts what it offloads: host memory, or NVMe files "
              "under nvme_path (DeepSpeed's ZeRO-Infinity)."),
    ] = "cpu"
    nvme_path: Annotated[
        str | None, Field(description="Directory on local NVMe for offload_device: nvme.")
    ] = None
    reduce_bucket_size: Annotated[
        int | None, Field(gt=0, description="Elements per gradient reduction bucket (unset: "
                          "DeepSpeed's 5e8; DeepSpeed refuses 0).")
    ] = None
    prefetch_bucket_size: Annotated[
        int | None, Field(ge=0, description="ZeRO-3: elements prefetched ahead of use (unset: "
                          "DeepSpeed's 5e7).")
    ] = None
    param_persistence_threshold: Annotated[
        int | None, Field(ge=0, description="ZeRO-3: parameters smaller than this stay unsharded.")
    ] = None
    deepcompile: Annotated[
        bool, Field(description="With compile: {enabled: true, scope: model}: DeepSpeed's "
                    "DeepCompile (compiler passes that place ZeRO's gathers and reductions inside "
                    "the compiled graph). DeepSpeed 0.19.8 runs it on CUDA only.")
    ] = False
    native: Annotated[
        dict[str, Any] | str,
        Field(description="A DeepSpeed config dict or a path to its JSON, merged last. \"auto\" "
              "values are filled from the spec; a value that contradicts the spec is an error."),
    ] = {}


    @model_validator(mode="after")
    def _nvme(self) -> DeepSpeedOptions:
        if (self.offload_device == "nvme") != (self.nvme_path is not None):
            raise rule_error(("deepspeed.nvme_path", "is required by offload_device: nvme, and "
                              "read only with it; set both or neither"))
        return self


class XlaOptions(Section):
    fsdp_version: Annotated[
        Literal[1, 2],
        Field(description="1: XlaFullyShardedDataParallel, one process per device. 2: SPMD "
              "SpmdFullyShardedDataParallel over a device mesh, one process per host."),
    ] = 1
    xla_fsdp_grad_ckpt: Annotated[
        bool | None,
        Field(description="Accelerate's name for activation checkpointing on XLA "
              "(checkpoint_module on each wrapped unit). Same meaning as activation_checkpointing."),
    ] = None
    flatten_parameters: Annotated[
        bool, Field(description="v1: flatten each unit's parameters into one tensor.")
    ] = True
    mesh_shape: Annotated[
        list[int] | None,
        Field(description="v2: device mesh shape (default: all devices on the `fsdp` axis).")
    ] = None
    compilation_cache: Annotated[
        str | None,
        Field(description="Directory for XLA's persistent compilation cache: a relaunch (resume, "
              "restart) reuses compiled graphs instead of compiling them again. Refused with "
              "torch_xla 2.9, which writes the cache but cannot read it back (docs/xla.md)."),
    ] = None
    preemption_sync: Annotated[
        bool,
        Field(description="v2 (SPMD) on TPU VM slices: agree on a preemption through torch_xla's "
              "preemption sync manager (TSL's SIGTERM notifier and the coordination service every "
              "host joins) instead of the loss reduction; every host then saves at the same step. "
              "Needs checkpoint.dir and preemption_signals: [SIGTERM] (what it listens to)."),
    ] = False
    xla_fsdp_settings: Annotated[
        dict[str, Any],
        Field(description="Accelerate's passthrough of XlaFullyShardedDataParallel arguments "
              "(`xla_fsdp_grad_ckpt` accepted here too)."),
    ] = {}
    native: Annotated[
        dict[str, Any], Field(description="Same as xla_fsdp_settings; merged last.")
    ] = {}
