"""DeepSpeed ZeRO: the spec becomes a DeepSpeed config, then `deepspeed.initialize` drives training.

`translate` needs no deepspeed import (so `polyshard validate/explain` work without it); the engine
imports deepspeed when it is built. Every value DeepSpeed would otherwise default is written
explicitly: `gradient_clipping` defaults to 1.0 in DeepSpeed 0.19.8 (docs/deepspeed.md).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from parallel.checkpoint import portable as ps
from parallel.engine.base import Engine, OptimizerArg, build_optimizer, require_fp32
from parallel.spec.model import Spec
from parallel.spec.io import SpecError
from parallel.checkpoint.dcp_state import read_model_optim, write_model_optim
from parallel.engine.wrap import apply_ac, plan_wrap

from . import schema
from .state import (
    is_zero,
    load_unfused,
    load_zero_state,
    master_names,
    partitions,
    unfused_state,
    zero_state,
)

STAGES = {"none": 0, "optimizer": 1, "grad_op": 2, "full": 3, "hybrid": 3}


def translate(spec: Spec) -> dict:
    """The DeepSpeed config this spec means, with `deepspeed.native` merged last."""
    config, origins = _config(spec)
    native = _native(spec.deepspeed.native)
    merged = _merge(config, origins, native, "deepspeed.native")
    return {"config": merged}


def _config(spec: Spec) -> tuple[dict, dict]:
    stage = STAGES[spec.shard]
    ds = spec.deepspeed
    zero: dict = {"stage": stage}
    origins = {"zero_optimization.stage": "shard", "gradient_clipping": "grad_clip",
               "train_micro_batch_size_per_gpu": "micro_batch_size",
               "gradient_accumulation_steps": "grad_accum_steps",
               "train_batch_size": "micro_batch_size x grad_accum_steps x world size",
               "bf16.enabled": "precision", "fp16.enabled": "precision"}
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
    if spec.shard == "hybrid":
        zero["zero_hpz_partition_size"] = spec.shard_group_size
        origins["zero_optimization.zero_hpz_partition_size"] = "topology.shard_group_size"
    if ds.reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = ds.reduce_bucket_size
        origins["zero_optimization.reduce_bucket_size"] = "deepspeed.reduce_bucket_size"
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
    ls = spec.loss_scale
    config = {
        "train_micro_batch_size_per_gpu": spec.micro_batch_size,
        "gradient_accumulation_steps": spec.grad_accum_steps,
        "train_batch_size": spec.micro_batch_size * spec.grad_accum_steps * spec.world_size,
        # Written even when off: DeepSpeed's default is 1.0, which changes every update silently.
        "gradient_clipping": spec.grad_clip or 0.0,
        "zero_optimization": zero,
        # with on_nonfinite: skip, ZeRO must drop a non-finite bf16 step itself (it checks fp32
        # gradients' norm anyway, but bf16's overflow check is off by default)
        "bf16": {"enabled": spec.precision == "bf16",
                 **({"check_grad_overflow": True} if spec.on_nonfinite == "skip"
                    and spec.precision == "bf16" else {})},
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
    if spec.global_batch_size is not None:
        origins["train_batch_size"] = "global_batch_size"
    return config, origins


def _native(native: dict | str) -> dict:
    """The passthrough as DeepSpeed will read it: a dict or a file (hjson, as DeepSpeed reads it),
    zero_optimization keys under one name each, and nothing DeepSpeed would refuse or ignore."""
    from .interop import read_config

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
            elif key not in config:
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


def fill_model_autos(config: dict, model: nn.Module) -> dict:
    """The config with MODEL_AUTOS' "auto" values computed from `model` (a copy)."""
    zero = dict(config.get("zero_optimization", {}))
    wanted = {k: f for k, f in MODEL_AUTOS.items() if zero.get(k.split(".")[1]) == "auto"}
    if not wanted:
        return config
    cfg = getattr(model, "config", None)
    sizes = getattr(cfg, "hidden_sizes", None)
    hidden = getattr(cfg, "hidden_size", None) or (max(sizes) if sizes else None)
    if hidden is None:
        raise SpecError([(f"deepspeed.native.{sorted(wanted)[0]}", "is \"auto\", which is filled "
                          "from model.config.hidden_size, and this model has none; give a number")])
    for key, formula in wanted.items():
        zero[key.split(".")[1]] = formula(int(hidden))
    return {**config, "zero_optimization": zero}


def _reinit_partitioned(model: nn.Module) -> None:
    """Hugging Face models initialise their weights in `post_init`, which under zero.Init runs on
    already-partitioned (empty) parameters, so the init is lost (measured: step-1 loss 5.767 instead
    of 5.548, docs/deepspeed.md). Re-run the model's own `_init_weights` on gathered parameters, in
    the same module order, so the weights equal those of a plain construction with the same seed."""
    init = getattr(model, "_init_weights", None)
    if init is None:
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        model.apply(init)


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def __init__(self, spec: Spec):
        super().__init__(spec)
        self.config = translate(spec)["config"]
        self.ds = None

    def _prepare(self, model, optimizer: OptimizerArg):
        import deepspeed

        # deepspeed.comm wraps the process group the Engine created. zero.Init reads its world size
        # from there: before deepspeed.initialize it would see 1 and reject the batch sizes.
        deepspeed.init_distributed(dist_init_required=False)
        if not isinstance(model, nn.Module):
            if self.spec.deepspeed.zero_init and STAGES[self.spec.shard] == 3:
                # Parameters are partitioned as each module is constructed: no rank holds them all.
                # the model-sized "auto" values are filled after construction; Init reads none
                zero = {k: v for k, v in self.config.get("zero_optimization", {}).items()
                        if v != "auto"}
                with deepspeed.zero.Init(config_dict_or_path={**self.config,
                                                              "zero_optimization": zero}):
                    model = model()
                _reinit_partitioned(model)
            else:
                model = model()
        require_fp32(model)
        self.config = fill_model_autos(self.config, model)
        self._record_params(model)
        # DeepSpeed does not wrap: the wrap policy only picks the units activation checkpointing
        # recomputes, so a model without _no_split_modules needs no policy unless that is on.
        if self.spec.checkpoint_activations:
            apply_ac(model, plan_wrap(model, self.spec.wrap))
        # Built here and handed over as an instance, so the same checks as on every backend apply
        # (ZeRO keeps the parameter objects: groups built before prepare need no mapping).
        client = self._optimizer_over(self._optimizer_factory(optimizer), model)
        self.ds, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=client,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=self.config, dist_init_required=False)
        return self.ds, ds_optimizer

    def _optimizer_factory(self, optimizer: OptimizerArg):
        """The client optimizer, or with `deepspeed.cpu_adam` DeepSpeed's compiled CPU Adam with the
        same hyper-parameters (AdamW's decoupled weight decay kept via adamw_mode)."""
        if not self.spec.deepspeed.cpu_adam:
            return lambda params: build_optimizer(optimizer, params)
        adams = (torch.optim.Adam, torch.optim.AdamW)
        if self.spec.offload == "none" or not (isinstance(optimizer, tuple) and optimizer[0] in adams):
            raise SpecError([("deepspeed.cpu_adam", "replaces an optimizer given as (Adam or AdamW, "
                              "kwargs) when offload is on; pass optimizer=(torch.optim.AdamW, {...}) "
                              "with offload: optimizer, or set cpu_adam: false")])
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        cls, kwargs = optimizer
        return lambda params: DeepSpeedCPUAdam(params, adamw_mode=cls is torch.optim.AdamW, **kwargs)

    def _scheduled_optimizer(self):
        # ZeRO's wrapper is no torch Optimizer (LambdaLR rejects it); it reads the lr from the
        # client optimizer's param_groups, so the scheduler drives that one.
        inner = getattr(self.optimizer, "optimizer", None)
        return inner if isinstance(inner, torch.optim.Optimizer) else self.optimizer

    def _backward(self, loss, micro_batches):
        # DeepSpeed divides by gradient_accumulation_steps itself, and counts micro-steps in step():
        # step() is called after every micro-batch and only updates at the accumulation boundary.
        self.ds.backward(loss)
        if not self.ds.is_gradient_accumulation_boundary():
            self.ds.step()

    def _skip_step(self):
        # DeepSpeed must still see the step boundary (its micro-step counters). ZeRO finds the
        # non-finite gradient norm and drops the update and the gradients itself; a plain optimizer
        # (ZeRO-0) skips every parameter whose grad is None.
        if not is_zero(self.optimizer):
            for p in self.ds.module.parameters():
                p.grad = None
        self.ds.step()
        return None

    def _optimizer_step(self):
        norm = None
        if not self.ds.zero_optimization() and self.spec.precision == "fp32":
            # Plain data parallel in fp32 records no norm; the gradients are whole and reduced here.
            grads = [p.grad for p in self.ds.module.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
        skipped = self.ds.skipped_steps
        self.ds.step()
        recorded = self.ds.get_global_grad_norm()
        if recorded is not None:
            norm = torch.as_tensor(float(recorded))
        return norm, self.ds.skipped_steps == skipped

    # Three layouts of fp32 master weights: flat partitions linked to each parameter (ZeRO-1/2/3,
    # the bf16 optimizer), one fp32 copy per parameter (FP16_UnfusedOptimizer, ZeRO-0 with bf16 or
    # fp16), or the parameters themselves (ZeRO-0 fp32, the client optimizer): one path each.
    def _save_model_optim(self, tmp: Path) -> None:
        if is_zero(self.optimizer):
            # Sharded: parameter i is written by rank i % world (each rank holds 1/world of the
            # state while saving); full: rank 0 writes everything. The gathers are collective.
            world, sharded = self.world_size, self.spec.state_dict == "sharded"
            mine = (lambda i: i % world == self.rank) if sharded else (lambda i: self.is_main)
            ps.save_state(zero_state(self.ds, mine), tmp)
        elif master_names(self.ds):
            ps.save_state(unfused_state(self.ds), tmp)  # replicated: DCP writes each entry once
        else:
            write_model_optim(tmp, self.ds.module, self.optimizer, self.spec.state_dict == "sharded",
                              self.rank, on_cpu=self.device.type == "cpu")

    def _load_model_optim(self, path: Path, manifest: dict) -> None:
        if is_zero(self.optimizer):
            load_zero_state(self.ds, path)
        elif master_names(self.ds):
            load_unfused(self.ds, path)
        else:
            read_model_optim(path, self.ds.module, self.optimizer)

    def state_tensors(self) -> dict:
        """Module parameters (ZeRO-3: this rank's partitions), the gradients ZeRO holds at the step
        boundary, and the optimizer: its state plus the fp32 master partitions."""
        params = list(self.ds.module.parameters())
        held = [getattr(p, "ds_tensor", p) for p in params]
        zero, base = self.optimizer, getattr(self.optimizer, "optimizer", self.optimizer)
        masters = [flat for _, _, flat in partitions(zero)] if is_zero(zero) else []
        grads = [p.grad for p in params] + [m.grad for m in masters]
        for buffers in getattr(zero, "averaged_gradients", {}).values() or []:
            grads += list(buffers or [])
        state = [v for st in base.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        return {"params": held, "grads": grads, "optimizer": state + masters}

    def gather_model(self) -> dict:
        if is_zero(self.optimizer):
            return zero_state(self.ds, lambda i: True, with_optimizer=False)["model"]
        if master_names(self.ds):
            return unfused_state(self.ds)["model"]
        return {ps.clean_name(k): v.detach().cpu() for k, v in self.ds.module.state_dict().items()}
