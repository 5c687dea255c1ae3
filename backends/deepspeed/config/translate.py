"""DeepSpeed's side of the spec, as plain data: the DeepSpeed config a spec means (what `polyshard
explain` prints and `deepspeed.initialize` takes), with `deepspeed.native` merged last. Its SpecErrors
are the backend's validation rules (parallel/descriptor.py). Every value DeepSpeed would otherwise
default is written explicitly: `gradient_clipping` defaults to 1.0 and gradients are reduced in the
compute dtype in DeepSpeed 0.19.8 (docs/deepspeed.md). No deepspeed import."""

from __future__ import annotations

from pathlib import Path

from backends.deepspeed.config import schema
from backends.deepspeed.config.autotp import tensor_parallel_block
from backends.deepspeed.config.pipe_config import apply_pipeline_config
from parallel.spec.errors import SpecError
from parallel.spec.model import Spec

STAGES = {"none": 0, "optimizer": 1, "grad_op": 2, "full": 3, "hybrid": 3}


def translate(spec: Spec) -> dict:
    """The DeepSpeed config this spec means, with `deepspeed.native` merged last."""
    if spec.precision == "fp8" and spec.float8.all_gather:
        raise SpecError([("float8.all_gather", "true on deepspeed: ZeRO gathers its bf16 or fp32 "
                          "partitions, torchao's float8 all-gather is FSDP2's tensor-subclass hook; "
                          "use float8.all_gather: false (the matmuls still run in float8)")])
    config, origins = _config(spec)
    apply_pipeline_config(spec, config, origins, STAGES[spec.shard])  # topology.pp (pipe_config.py)
    _tensor_parallel(spec, config, origins)
    _deepcompile(spec, config, origins)
    native = _native(spec.deepspeed.native)
    merged = _merge(config, origins, native, "deepspeed.native")
    _native_tp(spec, native.get("tensor_parallel"), "train_batch_size" in native)
    if "sequence_parallel_size" in native:
        raise SpecError([("deepspeed.native.sequence_parallel_size", f"{native['sequence_parallel_size']}"
                          ": sequence parallelism is topology.cp, which polyshard runs on every "
                          "backend alike (an all-to-all around the model's attention, docs/"
                          "long-sequences.md); set topology.cp and remove the native key")])
    out = {"config": merged}
    if spec.topology.cp > 1:  # polyshard's Ulysses (parallel/engine/model/context_parallel.py)
        out["cp"] = {"size": spec.topology.cp, "attention": "ulysses all-to-all"}
    return out


def _deepcompile(spec: Spec, config: dict, origins: dict) -> None:
    """DeepCompile lives in DeepSpeed's `compile` block and acts through DeepSpeedEngine.compile(),
    which compiles the whole model: scope model only."""
    if not spec.deepspeed.deepcompile:
        return
    if not (spec.compile.enabled and spec.compile.scope == "model"):
        raise SpecError([("deepspeed.deepcompile", "acts through DeepSpeedEngine.compile(), which "
                          "compiles the whole model; set compile: {enabled: true, scope: model} "
                          "or remove deepcompile")])
    if spec.compile.backend not in ("inductor", "eager"):  # DeepSpeed asserts on anything else
        raise SpecError([("compile.backend", f"{spec.compile.backend!r} with deepspeed.deepcompile: "
                          "DeepCompile builds on 'inductor' or 'eager' only; pick one of those or "
                          "remove deepcompile")])
    if STAGES[spec.shard] == 0:  # DeepSpeed would log a line and compile without its passes
        raise SpecError([("deepspeed.deepcompile", "DeepCompile's passes are ZeRO-1/2/3 passes, and "
                          "shard 'none' is ZeRO-0; use shard: optimizer, grad_op or full, or "
                          "remove deepcompile (compile.enabled still compiles the model)")])
    config["compile"] = {"deepcompile": True}
    origins["compile.deepcompile"] = "deepspeed.deepcompile"


def _tensor_parallel(spec: Spec, config: dict, origins: dict) -> None:
    """topology.tp as AutoTP (backends/deepspeed/config/autotp.py). train_batch_size is left out: under
    AutoTP DeepSpeed 0.19.8 checks it against different worlds in one job (measured: micro x
    accumulation x every rank at initialize, x data-parallel ranks in ZeRO-3's parameter
    conversion), and derives it right on each path when absent, as its AutoTP tutorial leaves it."""
    tp = spec.topology.tp
    if tp == 1:
        return
    if spec.deepspeed.deepcompile:
        raise SpecError([("deepspeed.deepcompile", "with topology.tp: DeepCompile's AutoTP pass is "
                          "not measured here (it needs CUDA); remove deepcompile or set tp: 1")])
    del config["train_batch_size"]
    config["tensor_parallel"] = tensor_parallel_block(tp, spec.topology.tp_plan)
    origins.update({"tensor_parallel.autotp_size": "topology.tp",
                    "tensor_parallel.vocab_parallel_lm_head": "topology.tp_plan",
                    "tensor_parallel.partition_config": "topology.tp_plan"})


# tensor_parallel keys that choose the split (or the head's loss): under topology.tp the split is
# the plan's (topology.tp_plan, or the model's own), on every backend alike.
SPLIT_KEYS = ("partition_config", "preset_model", "injection_policy_tuple", "kernel_inject",
              "replace_with_kernel_inject", "vocab_parallel_ce_backend")


def _native_tp(spec: Spec, block, batch_given: bool) -> None:
    """AutoTP written under deepspeed.native: its size is topology.tp (polyshard then feeds a TP
    group one batch and counts its targets once); what picks the split is topology.tp_plan."""
    if spec.topology.tp > 1 and batch_given:
        raise SpecError([("deepspeed.native.train_batch_size", "under AutoTP DeepSpeed checks it "
                          "against different world sizes in one job (docs/tp.md), so polyshard "
                          "leaves it to DeepSpeed to derive; remove it (global_batch_size states "
                          "the batch)")])
    if not isinstance(block, dict):
        return
    inner = block.get("tp", block.get("tensor_parallel")) or {}
    size = int(block.get("autotp_size") or 0)
    if spec.topology.tp == 1 and (size > 1 or int(inner.get("tp_size", 1) or 1) > 1):
        raise SpecError([("deepspeed.native.tensor_parallel", f"{block}: AutoTP is topology.tp in "
                          f"polyshard (every rank of a TP group then takes the same batch); set "
                          f"topology.tp: {max(size, int(inner.get('tp_size', 1) or 1))} and remove "
                          "it here")])
    problems = [(f"deepspeed.native.tensor_parallel.{k}", f"{block[k]!r} picks AutoTP's split; under "
                 "topology.tp the split is topology.tp_plan's (or the model's own plan), the same "
                 "on every backend: write the plan there") for k in SPLIT_KEYS
                if block.get(k) not in (None, "torch", False)]
    if int(inner.get("tp_grain_size", 1) or 1) != 1:
        problems.append(("deepspeed.native.tensor_parallel.tp.tp_grain_size", f"{inner['tp_grain_size']}"
                         ": uneven shards change the split; remove it"))
    if problems:
        raise SpecError(problems)


def _zero(spec: Spec) -> tuple[dict, dict]:
    """The zero_optimization block, and which spec field each of its keys comes from."""
    stage, ds = STAGES[spec.shard], spec.deepspeed
    zero: dict = {"stage": stage}
    origins = {"zero_optimization.stage": "shard"}
    _offload(spec, stage, zero, origins)
    if spec.shard == "hybrid":
        zero["zero_hpz_partition_size"] = spec.shard_group_size
        origins["zero_optimization.zero_hpz_partition_size"] = "topology.shard_group_size"
    if ds.reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = ds.reduce_bucket_size
        origins["zero_optimization.reduce_bucket_size"] = "deepspeed.reduce_bucket_size"
    elif stage:  # DeepSpeed's 5e8 is allocated whole whatever the model: no larger than it
        zero["reduce_bucket_size"] = MODEL_SIZED["zero_optimization.reduce_bucket_size"]
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = ds.gather_16bit_weights_on_model_save
        origins["zero_optimization.stage3_gather_16bit_weights_on_model_save"] = \
            "deepspeed.gather_16bit_weights_on_model_save"
        if ds.prefetch_bucket_size is not None:
            zero["stage3_prefetch_bucket_size"] = ds.prefetch_bucket_size
            origins["zero_optimization.stage3_prefetch_bucket_size"] = "deepspeed.prefetch_bucket_size"
        if ds.param_persistence_threshold is not None:
            zero["stage3_param_persistence_threshold"] = ds.param_persistence_threshold
            origins["zero_optimization.stage3_param_persistence_threshold"] = \
                "deepspeed.param_persistence_threshold"
    return zero, origins


def _offload(spec: Spec, stage: int, zero: dict, origins: dict) -> None:
    ds = spec.deepspeed
    if ds.offload_device == "nvme" and spec.offload == "none":
        raise SpecError([("deepspeed.offload_device", "'nvme' says where offloaded state goes, but "
                          "offload is 'none'; set offload: optimizer or params")])
    device = {"device": ds.offload_device, "pin_memory": spec.pin_memory,
              **({"nvme_path": ds.nvme_path} if ds.nvme_path else {})}
    if spec.offload != "none":
        if stage == 0:
            raise SpecError([("offload", f"{spec.offload!r} needs ZeRO (stage >= 1) on deepspeed; "
                              "use shard: optimizer, grad_op or full")])
        zero["offload_optimizer"] = dict(device)
    if spec.offload == "params":
        if stage != 3:
            raise SpecError([("offload", "'params' on deepspeed offloads ZeRO-3 partitions only; "
                              "use shard: full, or offload: optimizer")])
        zero["offload_param"] = dict(device)
    for block in ("offload_optimizer", "offload_param"):
        origins[f"zero_optimization.{block}.device"] = "offload / deepspeed.offload_device"
        origins[f"zero_optimization.{block}.pin_memory"] = "pin_memory"
        origins[f"zero_optimization.{block}.nvme_path"] = "deepspeed.nvme_path"


def _config(spec: Spec) -> tuple[dict, dict]:
    zero, origins = _zero(spec)
    origins.update({"gradient_clipping": "grad_clip",
                    "train_micro_batch_size_per_gpu": "micro_batch_size",
                    "gradient_accumulation_steps": "grad_accum_steps",
                    "train_batch_size": "micro_batch_size x grad_accum_steps x data-parallel size",
                    "bf16.enabled": "precision", "fp16.enabled": "precision"})
    ls = spec.loss_scale
    config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.grad_accum_steps,
        # DeepSpeed counts a cp group's ranks as data parallel (they reduce gradients together)
        "train_batch_size": spec.micro_batch_size * spec.grad_accum_steps * spec.dims.dp_cp,
        # Written even when off: DeepSpeed's default is 1.0, which changes every update silently.
        "gradient_clipping": spec.grad_clip or 0.0,
        "zero_optimization": zero,
        # with on_nonfinite: skip, ZeRO must drop a non-finite bf16 step itself (it checks fp32
        # gradients' norm anyway, but bf16's overflow check is off by default)
        "bf16": {"enabled": spec.compute == "bf16",
                 **({"check_grad_overflow": True} if spec.on_nonfinite == "skip"
                    and spec.compute == "bf16" else {})},
        "fp16": {"enabled": spec.precision == "fp16", "loss_scale": 0,
                 "initial_scale_power": ls.initial_scale_power, "loss_scale_window":
                 ls.growth_interval, "hysteresis": ls.hysteresis, "min_loss_scale": ls.min_scale},
        # The client optimizer is kept (same optimizer on every backend); these two let ZeRO accept
        # it with offload and when it is not Adam.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # polyshard reports the numbers; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
    }
    # Written even at its default: DeepSpeed reduces in the compute dtype unless told (engine.py)
    config["communication_data_type"] = spec.grad_reduce_dtype
    origins["communication_data_type"] = "reduce_dtype"
    origins.update({f"fp16.{k}": "loss_scale" for k in config["fp16"] if k != "enabled"})
    if spec.precision != "fp16":
        config["fp16"] = {"enabled": False}
    if spec.topology.cp > 1:
        origins["train_batch_size"] += " x topology.cp"
    if spec.global_batch_size is not None:
        origins["train_batch_size"] = "global_batch_size"
    return config, origins


def _native(native: dict | str) -> dict:
    """The passthrough as DeepSpeed will read it: a dict or a file (hjson, as DeepSpeed reads it),
    zero_optimization keys under one name each, and nothing DeepSpeed would refuse or ignore."""
    from backends.deepspeed.files.interop import read_config

    if not isinstance(native, dict):
        try:
            native = read_config(Path(native))
        except (OSError, SpecError) as err:
            raise SpecError([("deepspeed.native", f"{native!r} is not a readable DeepSpeed config "
                              f"({err}); give a dict or a path to a JSON config")]) from None
    problems = []
    for key in native:
        if key not in schema.TOP_LEVEL:
            hint = schema.closest(key, schema.TOP_LEVEL)
            problems.append((f"deepspeed.native.{key}", "DeepSpeed reads no such key (and would "
                             "ignore it silently)" + (f"; did you mean {hint!r}?" if hint else "")))
        elif key in ("optimizer", "scheduler"):
            problems.append((f"deepspeed.native.{key}", f"polyshard passes the {key} your script "
                             "gives engine.prepare() to DeepSpeed, which then ignores this block "
                             "silently; remove it and pass the same to prepare()"))
    zero = native.get("zero_optimization")
    if isinstance(zero, dict):
        problems += schema.zero_key_problems(zero, "deepspeed.native.zero_optimization")
        renamed = {schema.json_key(schema.ZERO_DEPRECATED.get(k, schema.field_of(k))): v
                   for k, v in zero.items()}
        native = {**native, "zero_optimization": renamed}
    if problems:
        raise SpecError(problems)
    return native


def _merge(config: dict, origins: dict, native: dict, where: str, prefix: str = "") -> dict:
    """Deep-merge `native` into `config`; a leaf the spec decided with another value is an error,
    and "auto" takes the spec's value (as in Accelerate and HF Trainer)."""
    out, problems = dict(config), []
    for key, value in native.items():
        path = f"{prefix}{key}"
        mine = config.get(key)
        if isinstance(value, dict) and isinstance(mine, dict):
            try:
                out[key] = _merge(mine, origins, value, where, f"{path}.")
            except SpecError as err:  # keep going: report every contradiction at once
                problems.extend(err.problems)
        elif value == "auto":
            if key not in config and path not in MODEL_AUTOS:
                problems.append((f"{where}.{path}", "is \"auto\" but the spec has no value for it; "
                                 "give a number or remove the key"))
            elif key not in config or model_sized(mine):
                out[key] = value  # filled from the model at prepare (fill_model_autos)
        elif key in config and mine != value and path in origins:
            problems.append((f"{where}.{path}", f"{value!r} contradicts {origins[path]}, which sets "
                             f"{mine!r}; change {origins[path]} instead or drop the key"))
        else:
            out[key] = value
    if problems:
        raise SpecError(problems)
    return out


# "auto" that Hugging Face and accelerate fill from the model's hidden size h (accelerate 1.11
# accelerator.py _prepare_deepspeed; transformers' deepspeed integration): polyshard fills it the same
# way at prepare, when the model is known.
MODEL_AUTOS = {"zero_optimization.reduce_bucket_size": lambda h: h * h,
               "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
               "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h}
# What the translation writes for the reduce bucket where the spec leaves it unset, named for
# explain: the model's trainable parameters, at most DeepSpeed's 5e8. DeepSpeed allocates the bucket
# whole whatever the model (1907 MiB per rank in fp32 for a 3 M-parameter model: docs/deepspeed.md);
# a bucket no larger than the model holds every gradient as before (the same reductions: the hot
# path's count is the native loop's), and a model of 5e8 parameters or more gets DeepSpeed's own.
# HF's h*h rule (MODEL_AUTOS, for a file's "auto") was measured first: 19 all-reduces a step where
# the native loop makes 4 (ZeRO-1, tiny Llama), and its prefetch / persistence sizes made ZeRO-3
# gather a mixture of experts' unused experts on one rank only (a gloo size mismatch).
MODEL_SIZED = {"zero_optimization.reduce_bucket_size": "min(5e8, trainable parameters) (at prepare)"}
REDUCE_DEFAULT = 500_000_000  # DeepSpeed 0.19.8's reduce_bucket_size


def model_sized(value) -> bool:
    """A value filled from the model at prepare: the spec's default (MODEL_SIZED) or a file's "auto"."""
    return value == "auto" or value in MODEL_SIZED.values()


def hidden_size(cfg) -> int | None:
    """The hidden size HF's rule reads (a config object or dict), as accelerate reads it."""
    get = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k, None)
    sizes = get("hidden_sizes")
    hidden = get("hidden_size") or (max(sizes) if sizes else None)
    return int(hidden) if hidden else None


def trainable(model) -> int:
    """Trainable parameters, ZeRO-3's partitioned ones at their full size (ds_numel)."""
    return sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()
               if p.requires_grad)


def fill_model_autos(config: dict, model) -> dict:
    """The config with its model-sized values computed from `model` (a copy): a file's "auto" by
    HF's rule from the model's hidden size, the spec's reduce bucket from its parameters."""
    cfg = getattr(model, "config", None) or {}
    return fill_sized(config, hidden_size(cfg), trainable(model))


def fill_sized(config: dict, hidden: int | None, params: float) -> dict:
    """fill_model_autos for a known hidden size (None: none) and trainable parameter count."""
    zero = dict(config.get("zero_optimization", {}))
    for key, formula in MODEL_AUTOS.items():
        leaf = key.split(".")[1]
        if zero.get(leaf) == "auto":
            if hidden is None:
                raise SpecError([(f"deepspeed.native.{key}", "is \"auto\", which is filled from "
                                  "model.config.hidden_size, and this model has none; give a number")])
            zero[leaf] = formula(hidden)
    if zero.get("reduce_bucket_size") in MODEL_SIZED.values():
        zero["reduce_bucket_size"] = int(max(1, min(REDUCE_DEFAULT, params)))
    return {**config, "zero_optimization": zero}


def exported(config: dict, auto: bool) -> dict:
    """The config for a file: the model-sized defaults as "auto" (accelerate and HF Trainer fill
    them by the same rule) or left out (a plain DeepSpeed file: DeepSpeed's parser takes no "auto",
    so DeepSpeed's own defaults apply there)."""
    zero = {k: ("auto" if auto else None) if v in MODEL_SIZED.values() else v
            for k, v in config.get("zero_optimization", {}).items()}
    return {**config, "zero_optimization": {k: v for k, v in zero.items() if v is not None}}
