"""XLA FSDP v1: XlaFullyShardedDataParallel, one process per device."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from backends.xla.common import _Xla, apply_xla_fsdp
from backends.xla.layout import member_ranges, split_members, v1_layout
from parallel.checkpoint.state.sink import Sink
from parallel.checkpoint.state.portable import buffers, clean_name, load_state, open_state, save_state
from parallel.checkpoint.state.optim_state import (
    groups_template,
    hyperparams,
    init_optimizer_state,
    merge_groups,
    read_groups,
    single_step,
)
from parallel.engine.core.step import OptimizerArg
from parallel.heap import young_heap


class XlaFsdpEngine(_Xla):
    per_parameter_grads = False  # each unit's parameters are one flat tensor (flatten_parameters)
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
        # XLA FSDP collects garbage in full once per unit it wraps (0.46 s each here; 80+ units
        # on a 70B model): each of those scans only what the wrap made, and one full collection
        # follows (parallel/heap.py)
        with young_heap(collect_after=True):
            model = apply_xla_fsdp(model, units, lambda m: XFSDP(m, **kwargs),
                                   self.spec.checkpoint_activations)
        sharded = [(p, [n for n, _ in members]) for p, members in v1_layout(model)]
        return model, self._optimizer_over(optimizer, model, sharded)

    def _xla_matrix_layout(self, model, p, name: str, shape: tuple):
        """Each parameter sharded on its own (flatten_parameters: false): a run of its flattened,
        padded elements per rank. Over several devices the pieces would need an all-to-all with
        split sizes, which torch_xla 2.9's process group refuses (its alltoall_base asserts)."""
        from parallel.engine.model.optim.layouts import flat_run
        from parallel.engine.model.optim.muon import Layout, MuonRefused

        if self.world_size > 1:
            raise MuonRefused(f"optimizer: torch.optim.Muon over {name} on XLA FSDP v1 over "
                              f"{self.world_size} devices: gathering each matrix needs an "
                              "all-to-all with split sizes, which torch_xla 2.9 refuses; not "
                              "built. Use xla.fsdp_version: 2 (docs/optimizers.md)")
        cut = p.numel()
        pieces = [flat_run(0, shape[0] * shape[1], r * cut, (r + 1) * cut)
                  for r in range(self.world_size)]
        return Layout(tuple(shape), None, pieces, self.rank,
                      slice(0, pieces[self.rank].numel))

    @contextmanager
    def _unwrapped(self):
        raise RuntimeError(
            "engine.unwrap() on XLA FSDP v1: the root unit flattens its parameters and frees the "
            "gathered copy after each forward, so the inner model cannot run outside the wrapper; "
            "use engine.generate (it runs every forward through the wrapper), or "
            "xla.fsdp_version: 2")
        yield  # pragma: no cover (a generator, so that `with` raises the error above)

    def _optimizer_step(self):
        # XLA FSDP reduces the norm over the flat shards; inf means "report only".
        return self._finish_step(self.model.clip_grad_norm_(self.spec.grad_clip or float("inf")))

    def _save_model_optim(self, sink: Sink) -> None:
        import torch_xla

        if self.spec.state_dict == "full":  # rank 0 writes everything, gathered one at a time
            return self._save_gathered(sink)
        # sharded: each rank writes the ranges of the original parameters its flat shards hold,
        # from host copies of its own shards (its part of the state: O(model / N)), no gather
        layout, model, state = v1_layout(self.model), {}, {}
        torch_xla.sync()
        for p, members in layout:
            ranges = member_ranges(p.detach().cpu(), members, self.rank)
            model.update(ranges)
            for key, value in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.shape == p.shape:
                    for name, r in member_ranges(value.detach().cpu(), members, self.rank).items():
                        state.setdefault(name, {})[key] = r
                    continue
                for name, _ in members:  # the step count: written by the rank with element 0
                    entry = state.setdefault(name, {})
                    if ranges[name].start == 0 and ranges[name].data.numel():
                        entry[key] = torch.as_tensor(value, dtype=torch.float32).cpu()
        if self.is_main:
            model.update(buffers(self.model))
        save_state({"model": self._aliased(model), "optim": {
            "state": state, "param_groups": self._groups(layout)}}, sink)

    def _groups(self, layout) -> list[dict]:
        return [{**hyperparams(g), "params": names}
                for g, names in zip(self.optimizer.param_groups, self._group_names(layout))]

    def _save_gathered(self, sink: Sink) -> None:
        import torch_xla.core.xla_model as xm

        layout, model, state = v1_layout(self.model), {}, {}
        for p, members in layout:  # one shard at a time: gathered whole (collective)
            full = xm.all_gather(p.detach(), dim=0).cpu()
            if self.is_main:
                model.update(split_members(full, members))
            for key, value in self.optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.shape == p.shape:
                    gathered = split_members(xm.all_gather(value, dim=0).cpu(), members)
                else:  # the step count, shared by the flat parameter's members
                    gathered = {n: torch.as_tensor(value, dtype=torch.float32).cpu() for n, _ in members}
                for name, t in gathered.items() if self.is_main else ():
                    state.setdefault(name, {})[key] = t
        if self.is_main:
            model = self._aliased({**model, **buffers(self.model)})
        save_state({"model": model, "optim": {"state": state, "param_groups": self._groups(layout)}},
                   sink)

    def gather_model(self) -> dict:
        import torch_xla.core.xla_model as xm

        state = buffers(self.model)
        for p, members in v1_layout(self.model):
            state.update(split_members(xm.all_gather(p.detach(), dim=0).cpu(), members))
        return self._aliased(state)

    def _group_names(self, layout) -> list[list[str]]:
        """The original names each optimizer group holds (a flat shard stands for its members)."""
        members = {id(p): [n for n, _ in m] for p, m in layout}
        return [[n for q in g["params"] for n in members[id(q)]] for g in self.optimizer.param_groups]

    def _load_model_optim(self, path: Path, manifest: dict, weights_only: bool = False) -> None:
        """Each rank reads the ranges its flat shards hold into host buffers (one per shard and
        optimizer entry: O(model / N)), then copies them to the device (`weights_only`: the
        shards and buffers alone, the optimizer left as it is)."""
        import torch_xla

        layout = v1_layout(self.model)
        reader = open_state(path)
        merged = None
        if not weights_only:
            groups_template(path, reader)  # none stored: refused before state is made
            init_optimizer_state(self.optimizer)  # entries to fill; lr 0 leaves the weights as they are
            torch_xla.sync()
            merged = merge_groups(self.optimizer.param_groups, read_groups(path, reader),
                                  self._group_names(layout))  # before anything is read
        hosts, model, state = self._host_buffers(layout, weights_only)
        template = {"model": self._aliased({**model, **{
                        k: torch.empty_like(v) for k, v in buffers(self.model).items()}})}
        if not weights_only:
            template["optim"] = {"state": state, "param_groups": groups_template(path, reader)}
        loaded = load_state(template, path, reader=reader)["model"]
        for p, _, host, _ in hosts:
            p.data.copy_(host.to(self.device))
        self.model.load_state_dict({k: loaded[clean_name(k)] for k in self.model.state_dict()
                                    if "_fsdp_shard" not in k}, strict=False)
        if not weights_only:
            self._optimizer_from(hosts, state, merged)
        drop_full_params(self.model)
        torch_xla.sync()

    def _host_buffers(self, layout, weights_only: bool) -> tuple[list, dict, dict]:
        """Host buffers to read into: [(shard, members, weights, {key: entry})], the weights'
        ranges by name, the optimizer entries' ranges by name (none when `weights_only`)."""
        model, state, hosts = {}, {}, []
        for p, members in layout:
            host = torch.zeros(p.numel(), dtype=p.dtype)  # XLA pads with zeros
            model.update(member_ranges(host, members, self.rank))
            entries = {}
            for key, value in ({} if weights_only else self.optimizer.state.get(p, {})).items():
                if torch.is_tensor(value) and value.shape == p.shape:
                    entries[key] = torch.zeros(p.numel(), dtype=value.dtype)
                    for name, r in member_ranges(entries[key], members, self.rank).items():
                        state.setdefault(name, {})[key] = r
                else:
                    for name, _ in members:
                        state.setdefault(name, {})[key] = torch.zeros(())
            hosts.append((p, members, host, entries))
        return hosts, model, state

    def _optimizer_from(self, hosts: list, state: dict, merged: list[dict]) -> None:
        """The optimizer's state from the host entries read, with the checkpoint's groups."""
        order = {id(q): i for i, q in enumerate(q for g in self.optimizer.param_groups
                                                for q in g["params"])}
        per_shard = {}
        for p, members, _, entries in hosts:
            if id(p) not in order:  # frozen: no optimizer entry
                continue
            step = single_step(state, [n for n, _ in members])
            per_shard[order[id(p)]] = {**{k: v.to(self.device) for k, v in entries.items()},
                                       **({"step": step} if step is not None else {})}
        groups = [{**g, "params": [order[id(q)] for q in live["params"]]}
                  for g, live in zip(merged, self.optimizer.param_groups)]
        self.optimizer.load_state_dict({"state": per_shard, "param_groups": groups})


def drop_full_params(model) -> None:
    """XLA FSDP keeps a unit's gathered parameters after forward where it is not resharded after
    forward (grad_op), freeing them in backward, and gathers again only when they are gone: after an
    evaluation's forward, the next forward would run on the values from before a load. Measured: a
    load into an engine that had trained and evaluated resumed 9e-3 off. Freed, as backward does."""
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel as XFSDP

    for unit in model.modules():
        if isinstance(unit, XFSDP) and unit.has_full_params:
            unit._free_full_params()
