"""XLA FSDP v2: SPMD SpmdFullyShardedDataParallel over a device mesh, one process per host."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from backends.xla.common import _Xla, apply_xla_fsdp
from parallel.checkpoint.state.sink import Sink
from parallel.checkpoint.state.portable import clean_name, load_state, open_state, save_state
from parallel.checkpoint.state.optim_state import groups_template, optim_by_name, optim_for_torch
from parallel.engine.core.step import OptimizerArg, clip_grad_norm
from parallel.engine.model.tp_plan import resolve_plan, style_of
from parallel.spec.errors import SpecError


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


def data_axis(cp: int):
    """The mesh axes that hold other tokens of the step: fsdp, and seq where topology.cp splits
    rows (parameters are sharded over both, as FSDP2 shards over dp_shard x cp)."""
    return ("fsdp", "seq") if cp > 1 else "fsdp"


def cp_shardings(model, cp: int) -> dict[str, tuple]:
    """topology.cp without tp: every parameter's dim 0 over (fsdp, seq); FSDPv2 alone would shard
    over fsdp and replicate over seq, and torch_xla 2.9's SPMD save planner drops partly
    replicated tensors (tp_shardings' note)."""
    return {name: (data_axis(cp),) + (None,) * (p.dim() - 1)
            for name, p in model.named_parameters() if p.dim() > 0}


def tp_shardings(model, plan: dict[str, str], cp: int = 1) -> dict[str, tuple]:
    """topology.tp under SPMD: the plan as a partition spec of each global parameter over the mesh's
    (fsdp, model) axes, by name (pure: tested on a meta-device model). The compiler inserts TP's
    collectives. Colwise splits outputs over `model` and FSDPv2's inputs over `fsdp`, rowwise the
    other way round; a colwise bias follows its outputs, a rowwise one is left to FSDPv2. The rest
    (embeddings, norms) is sharded over both axes: FSDPv2 would shard it over `fsdp` and replicate
    it over `model`, and torch_xla 2.9's SPMD save planner drops such partly replicated tensors
    (measured: no entry at all for the embedding and norms)."""
    specs, split, data = {}, set(), data_axis(cp)
    everything = (*data, "model") if cp > 1 else ("fsdp", "model")
    for path, module in model.named_modules():
        style = style_of(path, plan)
        if style is None:
            continue
        rowwise = style == "rowwise"
        specs[f"{path}.weight"] = (data, "model") if rowwise else ("model", data)
        split.add(id(module.weight))
        if module.bias is not None and not rowwise:
            specs[f"{path}.bias"] = ("model",)
            split.add(id(module.bias))
    for name, p in model.named_parameters():
        if id(p) not in split and p.dim() > 0:
            specs.setdefault(name, (everything,) + (None,) * (p.dim() - 1))
    return specs


def apply_tp(model, mesh, shardings: dict[str, tuple]) -> None:
    """Mark each parameter with its partition spec (tp_shardings) over `mesh`."""
    import torch_xla.distributed.spmd as xs

    params = dict(model.named_parameters())
    for name, spec in shardings.items():
        xs.mark_sharding(params[name], mesh, spec)


class XlaSpmdEngine(_Xla):
    def _before_runtime(self) -> None:
        import torch_xla.runtime as xr

        xr.use_spmd()  # must precede every XLA tensor: it changes how the runtime is set up

    def _check_runtime(self) -> None:
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        n, tp, cp = xr.global_runtime_device_count(), self.spec.topology.tp, self.spec.topology.cp
        if n % (tp * cp):
            field, degree = ("topology.tp", tp) if n % tp else ("topology.cp", tp * cp)
            raise SpecError([(field, f"{degree} (tp x cp) does not divide this host's {n} devices "
                              f"({xr.device_type()}); on CPU the devices are virtual: "
                              f"CPU_NUM_DEVICES={degree} (or a multiple) gives {degree}, and "
                              "`polyshard launch` sets it when unset")])
        if cp > 1:  # (fsdp, seq, model): rows split over seq (translate refuses a mesh_shape)
            shape, names = (n // (tp * cp), cp, tp), ("fsdp", "seq", "model")
        else:
            shape, names = tuple(self.spec.xla.mesh_shape or (n // tp, tp)), ("fsdp", "model")
        if int(np.prod(shape)) != n or len(shape) != len(names):
            raise SpecError([("xla.mesh_shape", f"{list(shape)} must be 2-D (fsdp, model) with "
                              f"{n} devices in all")])
        self.mesh = xs.Mesh(np.arange(n), shape, names)
        xs.set_global_mesh(self.mesh)
        self.devices_per_process = shape[0]

    @contextmanager
    def _unwrapped(self):
        # the parameters are sharded tensors the compiler partitions: the inner model runs as is
        from parallel.engine.infer.generate import library_model

        yield library_model(self.model)

    def _generation_layout(self, rows: int):
        import torch_xla.distributed.spmd as xs

        # rows over the fsdp axis where they divide it, else every device holds them all
        axis = "fsdp" if rows % self.mesh.mesh_shape[0] == 0 else None
        return lambda t: xs.mark_sharding(t, self.mesh, (axis,) + (None,) * (t.dim() - 1))

    def _agreed_flag(self):
        return _SyncPoint() if self.spec.xla.preemption_sync else super()._agreed_flag()

    def _prepare(self, model, optimizer: OptimizerArg):
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
            SpmdFullyShardedDataParallel as FSDPv2,
        )

        model, units = self._build(model)
        tp, cp = self.spec.topology.tp, self.spec.topology.cp
        if tp > 1:  # before FSDPv2, which skips what is already sharded
            plan = resolve_plan(model, tp, self.spec.topology.tp_plan, self.say)
            apply_tp(model, self.mesh, tp_shardings(model, plan, cp))
        elif cp > 1:
            apply_tp(model, self.mesh, cp_shardings(model, cp))
        model = apply_xla_fsdp(model, units, lambda m: FSDPv2(
            m, mesh=self.mesh, shard_output=shard_output, **self.plan["kwargs"]),
            self.spec.checkpoint_activations)
        return model, self._optimizer_over(optimizer, model)

    def parity_facts(self) -> dict:
        """How the parameters are laid out over the mesh (the tests assert real sharding)."""
        import torch_xla

        matrices = [p for p in self.model.parameters() if p.dim() == 2]
        specs = [torch_xla._XLAC._get_xla_sharding_spec(p) for p in matrices]
        return {"devices": int(self.mesh.size()), "matrix_params": len(matrices),
                "sharded_params": sum("devices=[" in s for s in specs), "example_spec": specs[0],
                "matrix_specs": sorted(set(specs))}

    def _input_sharding(self) -> dict:
        import torch_xla.distributed.spmd as xs

        if len(self.mesh.mesh_shape) > 2:
            # cp's mesh (fsdp, seq, model): a row's spec leaves the model axis out, and torch_xla
            # 2.9's ShardingSpec fails on that partial replication inside MpDeviceLoader
            # ("IndexError: too many indices for tensor of dimension 2", measured); the batch
            # goes over whole and _to_device lays each micro-batch out as the step's own batches
            return {}
        return {"input_sharding": xs.ShardingSpec(self.mesh, ("fsdp", self._seq))}

    @property
    def _seq(self):
        """The axis a row's tokens are split over: seq with topology.cp, else none."""
        return "seq" if self.spec.topology.cp > 1 else None

    def _to_device(self, batch):
        import torch_xla.distributed.spmd as xs

        batch = super()._to_device(batch)
        for t in (batch.values() if isinstance(batch, dict) else batch):
            # rows over fsdp; tokens over seq (a 4-D packed mask: its query dimension)
            spec = ("fsdp", self._seq) if t.dim() == 2 else (
                ("fsdp", None, self._seq, None) if t.dim() == 4 else None)
            xs.mark_sharding(t, self.mesh, spec or ("fsdp",) + (None,) * (t.dim() - 1))
        return batch

    def _autocast(self):
        if self.spec.precision == "bf16":
            return torch.autocast("xla", dtype=torch.bfloat16)
        return super()._autocast()

    def _optimizer_step(self):
        return self._finish_step(clip_grad_norm(self.model.parameters(), self.spec.grad_clip))

    def gather_model(self) -> dict:
        return {clean_name(k): v.detach().cpu() for k, v in self.model.state_dict().items()}

    def _names(self) -> dict[int, str]:
        return {id(p): clean_name(n) for n, p in self.model.named_parameters()}

    def _save_model_optim(self, sink: Sink) -> None:
        from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

        state = {"model": {clean_name(k): v for k, v in self.model.state_dict().items()},
                 "optim": optim_by_name(self.optimizer, self._names())}
        if self.spec.state_dict == "sharded":  # the SPMD planner writes each device's shards
            save_state(state, sink, planner=SPMDSavePlanner())
            return
        whole = _to_cpu(state)  # full: whole tensors (every process takes part), the first writes
        if self.is_main:
            save_state(whole, sink, collective=False)

    def _load_model_optim(self, path: Path, manifest: dict, weights_only: bool = False) -> None:
        from torch.distributed.checkpoint.state_dict import _init_optim_state
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        own, reader = self.model.state_dict(), open_state(path)
        if weights_only:  # the optimizer as it is: no state created
            template = {"model": {clean_name(k): v for k, v in own.items()}}
            load_state(template, path, planner=SPMDLoadPlanner(), reader=reader)
            self.model.load_state_dict({k: template["model"][clean_name(k)] for k in own})
            return
        # DCP loads into existing tensors: a fresh optimizer has no state yet (measured: "Missing
        # key in checkpoint state_dict: optim."), so create it with a zero-lr step first (after
        # checking that there is optimizer state to read: a refused load changes nothing).
        groups_template(path, reader)
        _init_optim_state(self.optimizer)
        names = self._names()
        osd = optim_by_name(self.optimizer, names)
        template = {"model": {clean_name(k): v for k, v in own.items()},
                    "optim": {"state": osd["state"], "param_groups": groups_template(path, reader)}}
        load_state(template, path, planner=SPMDLoadPlanner(), reader=reader)
        self.model.load_state_dict({k: template["model"][clean_name(k)] for k in own})
        self.optimizer.load_state_dict(optim_for_torch(
            self.optimizer, template["optim"]["state"], template["optim"]["param_groups"], names))


def _to_cpu(tree):
    """Whole CPU copies of every tensor in a nested state (sharded XLA tensors gathered)."""
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_cpu(v) for v in tree)
    return tree.detach().cpu() if isinstance(tree, torch.Tensor) else tree


class _SyncPoint:
    """xla.preemption_sync: torch_xla's preemption sync manager decides, as its CheckpointManager
    (chkpt_on_preemption) does: TSL's notifier catches SIGTERM on a thread of its own and the
    coordination service every host joins picks one step at which `_sync_point_reached` is true on
    every process. Nothing rides the loss reduction; it is asked once per step, on the host. Measured
    on the CPU client: SIGTERM during step 2 -> reached at step 3 (docs/reliability.md)."""

    rides_loss = False

    def __init__(self):
        import torch_xla
        import torch_xla.runtime as xr

        # TPU VMs discover the coordinator's address; the CPU client (tests) has one host
        ip = xr.get_master_ip() if xr.device_type() == "TPU" else "127.0.0.1"
        torch_xla._XLAC._ensure_xla_coordinator_initialized(xr.process_index(),
                                                            xr.process_count(), ip)
        torch_xla._XLAC._activate_preemption_sync_manager()

    def record(self, step: int, reduced) -> None:  # nothing rides the loss
        pass

    def agreed(self, step: int) -> float:
        import torch_xla

        return 1.0 if torch_xla._XLAC._sync_point_reached(step) else 0.0

    def at(self, step: int) -> None:
        pass
