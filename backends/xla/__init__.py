"""PyTorch/XLA FSDP: `xla.fsdp_version: 1` (XlaFullyShardedDataParallel, one process per device) and
`2` (SPMD SpmdFullyShardedDataParallel, one process per host over a device mesh).

`translate` is plain data (no torch_xla import). The engine imports torch_xla when built. The step is
`optimizer.step()` then `xm.mark_step()`: FSDP has already reduce-scattered the gradients, so
`xm.optimizer_step` (which all-reduces them again) would be wrong. Nothing in the step reads a value
back to the host; `StepResult.loss` does when it is read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
from torch import nn

from parallel.engine.base import Engine, OptimizerArg, require_fp32
from parallel.engine.params import aliases, retie
from parallel.checkpoint.portable import (
    clean_name,
    full_template,
    groups_template,
    hyperparams,
    init_optimizer_state,
    load_state,
    merge_groups,
    optim_by_name,
    optim_for_torch,
    save_state,
    single_step,
)
from parallel.spec.model import Spec
from parallel.spec.io import SpecError, merge_native
from parallel.engine.wrap import disable_kv_cache, plan_wrap

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def _check_reduce(spec: Spec) -> None:
    """v1 reduces in fp32 or in the compute dtype (fp32_reduce_scatter); SPMD v2 reduces the fp32
    gradients of its fp32 parameters in the compiled graph."""
    reduce, x = spec.grad_reduce_dtype, spec.xla
    allowed = {"fp32"} if x.fsdp_version == 2 else {"fp32", spec.precision}
    if reduce not in allowed:
        raise SpecError([("reduce_dtype", f"{spec.reduce_dtype!r} ({reduce}) with precision "
                          f"{spec.precision!r}: XLA FSDP v{x.fsdp_version} reduces gradients in "
                          f"{' or '.join(sorted(allowed))}; use one of those")])


def translate(spec: Spec) -> dict:
    _check_reduce(spec)
    x = spec.xla
    settings = {k: v for k, v in x.xla_fsdp_settings.items() if k != "xla_fsdp_grad_ckpt"}
    if x.fsdp_version == 2:
        if spec.topology.procs_per_node != 1:
            raise SpecError([("topology.procs_per_node", f"{spec.topology.procs_per_node} with "
                              "xla.fsdp_version: 2: SPMD runs one process per host that drives all "
                              "its devices; set procs_per_node: 1")])
        if spec.shard != "full":
            raise SpecError([("shard", f"{spec.shard!r} needs xla.fsdp_version: 1: SPMD FSDPv2 "
                              "shards parameters and lets the compiler schedule the gathers; use "
                              "shard: full")])
        return {"api": "SpmdFullyShardedDataParallel", "mesh": x.mesh_shape or "all devices x 1",
                "mesh_axes": ["fsdp", "model"], "autocast": DTYPE_NAMES[spec.precision],
                "activation_checkpointing": spec.checkpoint_activations,
                "kwargs": {**settings, **x.native}}
    mixed = spec.precision != "fp32"
    kwargs = {"reshard_after_forward": spec.shard == "full",
              "flatten_parameters": x.flatten_parameters,
              "compute_dtype": DTYPE_NAMES[spec.precision],
              "buffer_dtype": "float32",
              "fp32_reduce_scatter": mixed and spec.grad_reduce_dtype == "fp32"}
    origins = {"reshard_after_forward": "shard", "flatten_parameters": "xla.flatten_parameters",
               "compute_dtype": "precision", "fp32_reduce_scatter": "reduce_dtype"}
    kwargs = merge_native(kwargs, origins, settings, "xla.xla_fsdp_settings")
    kwargs = merge_native(kwargs, origins, x.native, "xla.native")
    return {"api": "XlaFullyShardedDataParallel", "kwargs": kwargs,
            "activation_checkpointing": spec.checkpoint_activations}


def local_run(spec: Spec) -> tuple[dict, dict]:
    """The same job on one host's CPU client (PJRT_DEVICE=CPU), which is single-process: v1 runs
    at world size 1 with the whole global batch in its micro-batches; v2 runs one process over
    `world_size` virtual devices. Other devices run the spec as written."""
    from parallel.launch.envinfo import detect_pjrt_device

    data = spec.model_dump(mode="json", exclude_unset=True)
    if detect_pjrt_device() != "CPU":
        return data, {}
    world = spec.world_size
    data["topology"] = {**data.get("topology", {}), "nodes": 1, "procs_per_node": 1}
    if spec.xla.fsdp_version == 1:
        data["micro_batch_size"] = spec.micro_batch_size * world
        return data, {"CPU_NUM_DEVICES": "1"}
    return data, {"CPU_NUM_DEVICES": str(world)}


def XlaEngine(spec: Spec) -> Engine:
    return (XlaSpmdEngine if spec.xla.fsdp_version == 2 else XlaFsdpEngine)(spec)


class _Xla(Engine):
    name = "xla_fsdp"

    def __init__(self, spec: Spec):
        self.plan = translate(spec)
        if spec.xla.compilation_cache:
            import torch_xla
            import torch_xla.runtime as xr

            if not torch_xla._XLAC._xla_computation_cache_is_initialized():  # once per process
                xr.initialize_cache(spec.xla.compilation_cache)
        self._before_runtime()
        super().__init__(spec)
        import torch_xla

        self.ctx = dataclasses.replace(self.ctx, device=torch_xla.device())
        self._check_runtime()

    def _before_runtime(self) -> None:
        pass

    def _check_runtime(self) -> None:
        pass

    def _device_loader(self, loader):
        """Batches reach the device through MpDeviceLoader: host-to-device copies overlap the step."""
        import torch_xla.distributed.parallel_loader as pl

        return pl.MpDeviceLoader(loader, self.device, **self._input_sharding())

    def _input_sharding(self) -> dict:
        return {}

    def _build(self, model) -> tuple[nn.Module, list]:
        model = model if isinstance(model, nn.Module) else model()
        require_fp32(model)
        plan = self._record_params(model)
        units = plan_wrap(model, self.spec.wrap)
        if self.spec.checkpoint_activations:
            disable_kv_cache(model)
        model = model.to(self.device)
        retie(model, plan.tied)  # .to(xla) gives every module its own copy of a tied weight
        return model, units

    def _wrap_units(self, model: nn.Module, units, wrap) -> nn.Module:
        """Wrap each unit (children first) in place, then the root."""
        from torch_xla.distributed.fsdp import checkpoint_module

        for name, unit in units:
            inner = checkpoint_module(unit) if self.spec.checkpoint_activations else unit
            model.set_submodule(name, wrap(inner))
        return wrap(model)

    def _aliased(self, model: dict) -> dict:
        """Tied weights under each of their names, as the model's state_dict() has them."""
        for alias, canonical in aliases(self.params.tied).items():
            if canonical in model:
                model[alias] = model[canonical]
        return model

    def _skip_step(self):
        import torch_xla.core.xla_model as xm

        self.optimizer.zero_grad(set_to_none=True)
        xm.mark_step()  # end the skipped step's graph here, as a taken step's would end
        return None

    def _finish_step(self, norm):
        import torch_xla.core.xla_model as xm

        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        xm.mark_step()  # one compiled graph per step: forward, backward, update
        return norm, True


class XlaFsdpEngine(_Xla):
    def _check_runtime(self) -> None:
        import torch_xla.runtime as xr

        if xr.device_type() == "CPU" and (self.world_size > 1 or
                                          xr.global_runtime_device_count() > 1):
            raise RuntimeError(
                "xla.fsdp_version: 1 on PJRT_DEVICE=CPU runs on one device only: torch_xla 2.9's CPU "
                "client is single-process (2 devices in one process abort in rendezvous; 2 "
                "processes each get a world of size 1). Use xla.fsdp_version: 2 with "
                "CPU_NUM_DEVICES=N for sharding on CPU, or a TPU for v1 (docs/xla.md)")

    def _prepare(self, model, optimizer: OptimizerArg):
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as XFSDP

        model, units = self._build(model)
        kwargs = dict(self.plan["kwargs"])
        for key in ("compute_dtype", "buffer_dtype"):
            if isinstance(kwargs.get(key), str):
                kwargs[key] = getattr(torch, kwargs[key])
        model = self._wrap_units(model, units, lambda m: XFSDP(m, **kwargs))
        sharded = [(p, [n for n, _ in members]) for p, members in v1_layout(model)]
        return model, self._optimizer_over(optimizer, model, sharded)

    def _optimizer_step(self):
        # XLA FSDP reduces the norm over the flat shards; inf means "report only".
        return self._finish_step(self.model.clip_grad_norm_(self.spec.grad_clip or float("inf")))

    def _save_model_optim(self, tmp: Path) -> None:
        import torch_xla.core.xla_model as xm

        layout, model, state = v1_layout(self.model), {}, {}
        for p, members in layout:  # one shard at a time: gathered whole, split into the originals
            full = xm.all_gather(p.detach(), dim=0).cpu()
            model.update(split_members(full, members))
            for key, value in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.shape == p.shape:
                    gathered = split_members(xm.all_gather(value, dim=0).cpu(), members)
                else:  # the step count, shared by the flat parameter's members
                    gathered = {n: torch.as_tensor(value, dtype=torch.float32).cpu() for n, _ in members}
                for name, t in gathered.items():
                    state.setdefault(name, {})[key] = t
        model = self._aliased({**model, **self._buffers()})
        groups = [{**hyperparams(g), "params": names}
                  for g, names in zip(self.optimizer.param_groups, self._group_names(layout))]
        if self.is_main:  # whole tensors, written once
            save_state({"model": model, "optim": {"state": state, "param_groups": groups}}, tmp,
                       collective=False)

    def gather_model(self) -> dict:
        import torch_xla.core.xla_model as xm

        state = self._buffers()
        for p, members in v1_layout(self.model):
            state.update(split_members(xm.all_gather(p.detach(), dim=0).cpu(), members))
        return self._aliased(state)

    def _group_names(self, layout) -> list[list[str]]:
        """The original names each optimizer group holds (a flat shard stands for its members)."""
        members = {id(p): [n for n, _ in m] for p, m in layout}
        return [[n for q in g["params"] for n in members[id(q)]] for g in self.optimizer.param_groups]

    def _buffers(self) -> dict:
        return {clean_name(k): v.cpu() for k, v in self.model.state_dict().items()
                if "_fsdp_shard" not in k}

    def _load_model_optim(self, path: Path, manifest: dict) -> None:
        import torch_xla.core.xla_model as xm

        layout = v1_layout(self.model)
        init_optimizer_state(self.optimizer)  # entries to fill; lr 0 leaves the weights as they are
        xm.mark_step()
        shapes = {n: shape for _, members in layout for n, shape in members}
        keys = {n: [k for k, v in self.optimizer.state[p].items()
                    if k == "step" or (torch.is_tensor(v) and v.shape == p.shape)]
                for p, members in layout for n, _ in members}
        template = full_template(shapes, keys, groups_template(path))
        template["model"] = self._aliased({**template["model"], **{
            k: torch.empty_like(v) for k, v in self._buffers().items()}})
        model, state = load_state(template, path)["model"], template["optim"]["state"]
        merged = merge_groups(self.optimizer.param_groups, template["optim"]["param_groups"],
                              self._group_names(layout))  # before anything is set
        order = {id(q): i for i, q in enumerate(q for g in self.optimizer.param_groups
                                                for q in g["params"])}
        per_shard, rank = {}, self.rank
        for p, members in layout:
            p.data.copy_(shard_of(model, members, p.numel(), rank).to(self.device))
            if id(p) not in order:  # frozen: no optimizer entry
                continue
            entries = {k: shard_of({n: state[n][k] for n, _ in members}, members, p.numel(), rank)
                       for k in keys[members[0][0]] if k != "step"}
            step = single_step(state, [n for n, _ in members])
            per_shard[order[id(p)]] = {**entries, **({"step": step} if step is not None else {})}
        self.model.load_state_dict({k: model[clean_name(k)] for k in self.model.state_dict()
                                    if "_fsdp_shard" not in k}, strict=False)
        groups = [{**g, "params": [order[id(q)] for q in live["params"]]}
                  for g, live in zip(merged, self.optimizer.param_groups)]
        self.optimizer.load_state_dict({"state": per_shard, "param_groups": groups})
        xm.mark_step()


def v1_layout(model) -> list[tuple[nn.Parameter, list[tuple[str, torch.Size]]]]:
    """Each sharded parameter of an XlaFullyShardedDataParallel model with the original parameters
    it holds, in order: one when parameters are sharded one by one, several when a unit's are
    flattened (flatten_parameters). Read from the model's own shard metadata, as XLA's
    consolidate_sharded_state_dicts reads it."""
    md = model.get_shard_metadata()
    layout = []
    for name, p in model.named_parameters():
        if p.dim() != 1:
            raise RuntimeError("XLA FSDP v1 with shard_param_on_dim_0 has no portable layout; "
                               "leave it unset")
        parts = name.replace("_fpw_module.", "").split(".")
        cut = next(i for i, part in enumerate(parts) if part.startswith("_fsdp_shard"))
        prefix, suffix = ".".join(parts[:cut]), ".".join(parts[cut:])
        info = md["shard_info"][prefix][suffix]
        full = f"{prefix}.{info['_orig_name']}" if prefix else info["_orig_name"]
        if full in md["flatten_info"]:
            names, shapes, _ = md["flatten_info"][full]
            owner = full.rsplit(".", 1)[0]
            members = [(clean_name(f"{owner}.{n}"), torch.Size(s)) for n, s in zip(names, shapes)]
        else:
            members = [(clean_name(full), torch.Size(info["_orig_size"]))]
        layout.append((p, members))
    return layout


def split_members(flat: torch.Tensor, members) -> dict[str, torch.Tensor]:
    """Gathered (padded) flat shards -> each original tensor, by name."""
    out, offset = {}, 0
    for name, shape in members:
        out[name] = flat[offset:offset + shape.numel()].view(shape).clone()
        offset += shape.numel()
    return out


def shard_of(tensors: dict, members, shard_numel: int, rank: int) -> torch.Tensor:
    """The inverse: concatenate the originals, pad as XLA FSDP pads, take this rank's slice."""
    flat = torch.cat([tensors[n].reshape(-1) for n, _ in members])
    end = shard_numel * (rank + 1)
    flat = torch.nn.functional.pad(flat, (0, max(0, end - flat.numel())))
    return flat[shard_numel * rank:end].clone()


def shard_output(output, mesh) -> None:
    """FSDPv2 needs the batch dimension of a module's output marked; Hugging Face modules return
    objects and tuples, so mark the first tensor (logits, hidden states) found."""
    import torch_xla.distributed.spmd as xs

    tensor = getattr(output, "logits", None)
    if tensor is None:
        items = output if isinstance(output, (tuple, list)) else (output,)
        tensor = next((t for t in items if isinstance(t, torch.Tensor)), None)
    if tensor is not None and tensor.dim() > 0:
        xs.mark_sharding(tensor, mesh, ("fsdp",) + (None,) * (tensor.dim() - 1))


class XlaSpmdEngine(_Xla):
    def _before_runtime(self) -> None:
        import torch_xla.runtime as xr

        xr.use_spmd()  # must precede every XLA tensor: it changes how the runtime is set up

    def _check_runtime(self) -> None:
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        n = xr.global_runtime_device_count()
        shape = tuple(self.spec.xla.mesh_shape or (n, 1))
        if int(np.prod(shape)) != n or len(shape) != 2:
            raise SpecError([("xla.mesh_shape", f"{list(shape)} must be 2-D (fsdp, model) with "
                              f"{n} devices in all")])
        self.mesh = xs.Mesh(np.arange(n), shape, ("fsdp", "model"))
        xs.set_global_mesh(self.mesh)
        self.devices_per_process = shape[0]

    def _prepare(self, model, optimizer: OptimizerArg):
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
            SpmdFullyShardedDataParallel as FSDPv2,
        )

        model, units = self._build(model)
        model = self._wrap_units(model, units, lambda m: FSDPv2(
            m, mesh=self.mesh, shard_output=shard_output, **self.plan["kwargs"]))
        return model, self._optimizer_over(optimizer, model)

    def parity_facts(self) -> dict:
        """How the parameters are laid out over the mesh (the tests assert real sharding)."""
        import torch_xla

        matrices = [p for p in self.model.parameters() if p.dim() == 2]
        specs = [torch_xla._XLAC._get_xla_sharding_spec(p) for p in matrices]
        return {"devices": int(self.mesh.size()), "matrix_params": len(matrices),
                "sharded_params": sum("devices=[" in s for s in specs), "example_spec": specs[0]}

    def _input_sharding(self) -> dict:
        import torch_xla.distributed.spmd as xs

        return {"input_sharding": xs.ShardingSpec(self.mesh, ("fsdp", None))}

    def _to_device(self, batch):
        import torch_xla.distributed.spmd as xs

        batch = super()._to_device(batch)
        for t in (batch.values() if isinstance(batch, dict) else batch):
            xs.mark_sharding(t, self.mesh, ("fsdp",) + (None,) * (t.dim() - 1))
        return batch

    def _autocast(self):
        if self.spec.precision == "bf16":
            return torch.autocast("xla", dtype=torch.bfloat16)
        return super()._autocast()

    def _optimizer_step(self):
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if self.spec.grad_clip is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.spec.grad_clip, norm)
        return self._finish_step(norm)

    def gather_model(self) -> dict:
        return {clean_name(k): v.detach().cpu() for k, v in self.model.state_dict().items()}

    def _names(self) -> dict[int, str]:
        return {id(p): clean_name(n) for n, p in self.model.named_parameters()}

    def _save_model_optim(self, tmp: Path) -> None:
        from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

        # Sharded XLA tensors: the SPMD planner writes each device's shards as DCP chunks.
        state = {"model": {clean_name(k): v for k, v in self.model.state_dict().items()},
                 "optim": optim_by_name(self.optimizer, self._names())}
        save_state(state, tmp, planner=SPMDSavePlanner())

    def _load_model_optim(self, path: Path, manifest: dict) -> None:
        from torch.distributed.checkpoint.state_dict import _init_optim_state
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        # DCP loads into existing tensors: a fresh optimizer has no state yet (measured: "Missing
        # key in checkpoint state_dict: optim."), so create it with a zero-lr step first.
        _init_optim_state(self.optimizer)
        names, own = self._names(), self.model.state_dict()
        osd = optim_by_name(self.optimizer, names)
        template = {"model": {clean_name(k): v for k, v in own.items()},
                    "optim": {"state": osd["state"], "param_groups": groups_template(path)}}
        load_state(template, path, planner=SPMDLoadPlanner())
        self.model.load_state_dict({k: template["model"][clean_name(k)] for k in own})
        self.optimizer.load_state_dict(optim_for_torch(
            self.optimizer, template["optim"]["state"], template["optim"]["param_groups"], names))
