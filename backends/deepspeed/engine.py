"""The DeepSpeed engine: `deepspeed.initialize` over the config translate.py writes, driven by the
shared training step. deepspeed is imported when the engine is built."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch

from backends.deepspeed.runtime.autotp_split import Split
from backends.deepspeed.checkpoint.fragments import LiveShards, load_sharded, sharded_state
from backends.deepspeed.runtime.library import import_deepspeed
from backends.deepspeed.runtime.parallelize import (
    apply_autotp_plan,
    apply_zero,
    build_model,
    check_arch_list,
    checked_split,
    keep_clipped_norm,
    known_config,
    start_deepspeed,
    zero3_visible,
)
from backends.deepspeed.checkpoint.state import (
    is_zero,
    load_plain,
    load_unfused,
    master_names,
    partitions,
    plain_state,
    save_per_parameter,
    unfused_state,
    zero_state,
)
from backends.deepspeed.config.translate import STAGES, fill_model_autos, translate
from parallel import dist as pdist
from parallel.checkpoint.state.sink import Sink
from parallel.checkpoint.state import portable as ps
from parallel.checkpoint.state.dcp_state import read_model_optim, write_model_optim
from parallel.engine.core.engine import Engine
from parallel.engine.model.tp_plan import resolve_plan
from parallel.engine.core.step import OptimizerArg, build_optimizer, check_built, clip_grad_norm
from parallel.engine.model.wrap import apply_ac, plan_wrap
from parallel.spec.errors import SpecError
from parallel.spec.model import Spec


class DeepSpeedEngine(Engine):
    name = "deepspeed"
    per_parameter_grads = False  # ZeRO steps flat fp32 partitions (ZeRO-0: see state.py)

    def __init__(self, spec: Spec, **context):
        super().__init__(spec, **context)
        self.config = translate(spec)["config"]
        self.ds = None
        self.split: Split | None = None  # what AutoTP split (topology.tp > 1)
        self.live = LiveShards()  # sharded saves' views, kept while they are live

    def _prepare(self, model, optimizer: OptimizerArg):
        start_deepspeed(self.ctx.local_rank, self.spec.deepspeed.deepcompile, self.device, self.say)
        if self.dims.pp > 1:
            return self._prepare_stages(model, optimizer)
        zero3 = STAGES[self.spec.shard] == 3
        model = build_model(model, known_config(self.config), zero3, self.spec.deepspeed.zero_init)
        check_built(model)
        self.config, expected = fill_model_autos(self.config, model), None
        if self.dims.tp > 1:  # the plan checked against the model, then AutoTP splits by it
            self.config, expected = apply_autotp_plan(self.config, model, self.dims.tp, resolve_plan(
                model, self.dims.tp, self.spec.topology.tp_plan, self.say))
        self._record_params(model)
        self._checkpoint_and_compile(model)
        client = self._optimizer_over(self._optimizer_factory(optimizer), model)
        self.ds, ds_optimizer = apply_zero(model, client, self.config)
        if is_zero(ds_optimizer):
            self._adopt_zero_muon(ds_optimizer, client)
        if not self.ds.zero_optimization() and self.spec.compute == "fp32" and self.spec.grad_clip:
            keep_clipped_norm(self.ds)
        self.split = checked_split(self.ds, expected) if expected is not None else None
        if self.spec.compile.enabled and self.spec.compile.scope == "model":
            # DeepSpeed's own call: it compiles ds.module in place and records that it did
            # (DeepCompile, compiled autograd and its nvtx switch hang off that record).
            self._apply_compile(self.ds.module, [], self._compile_whole)
        return self.ds, ds_optimizer

    def _checkpoint_and_compile(self, model) -> None:
        # DeepSpeed does not wrap: the wrap policy only picks the units activation checkpointing
        # recomputes and per-block compile compiles, so a model without _no_split_modules needs no
        # policy unless one of those is on. Checkpointing first, so the wrapper (and its recompute)
        # is compiled.
        compile_blocks = self.spec.compile.enabled and self.spec.compile.scope == "blocks"
        units = plan_wrap(model, self.spec.wrap) if (self.spec.checkpoint_activations
                                                     or compile_blocks) else []
        if self.spec.checkpoint_activations:
            apply_ac(model, units)
        if compile_blocks:
            self._apply_compile(model, units)

    def _prepare_stages(self, model, optimizer: OptimizerArg):
        """topology.pp: this rank's stage in DeepSpeed's PipelineModule, run by its PipelineEngine
        (pipe.py; the spec allows ZeRO-0 in fp32 only, pipe_config.py). The model is the view over
        the stage under the model's names: the optimizer's groups and checkpoints read those."""
        from backends.deepspeed.runtime.pipe import DeepSpeedPipeline

        model = build_model(model, known_config(self.config), False, False)
        check_built(model)
        self.config = fill_model_autos(self.config, model)
        self._record_params(model)
        view = self._apply_pipeline(model, DeepSpeedPipeline)
        for part in self.pipeline.parts:  # activation checkpointing inside the stage (no compile:
            self._checkpoint_and_compile(part)  # pipe_config.py refuses it with pp)
        client = self._optimizer_over(self._optimizer_factory(optimizer), view)
        self.ds, ds_optimizer = apply_zero(self.pipeline.module(self.dims.dp_cp), client,
                                           self.config)
        self.pipeline.attach(self.ds)
        return view, ds_optimizer

    def _compile_whole(self, backend, kwargs: dict) -> None:
        """DeepSpeedEngine.compile() with our counting backend. DeepCompile takes a backend *name*
        (asserts 'inductor' or 'eager', measured on an H100) and builds its own backend from it, so
        there the counter wraps what DeepSpeed built, and the graphs that run are still counted."""
        if not self.spec.deepspeed.deepcompile:
            self.ds.compile(backend=backend, compile_kwargs=kwargs)
            return
        check_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
        build = self.ds.get_deepspeed_compile_backend

        def counted(name, compile_kwargs, schedule):
            resolved, schedule = build(name, compile_kwargs, schedule)
            if resolved is None:  # DeepSpeed fell back to plain torch.compile(name): uncounted,
                return None, schedule  # so the watch reports the model as run eagerly
            backend.inner = resolved
            return backend, schedule

        self.ds.get_deepspeed_compile_backend = counted  # this instance only, for this one call
        try:
            self.ds.compile(backend=self.spec.compile.backend, compile_kwargs=kwargs)
        finally:
            del self.ds.get_deepspeed_compile_backend

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

        from backends.deepspeed.runtime.ops import announce_builds

        announce_builds(["cpu_adam"], self.say)
        cls, kwargs = optimizer
        return lambda params: DeepSpeedCPUAdam(params, adamw_mode=cls is torch.optim.AdamW, **kwargs)

    def _matrix_layout(self, model, p, name: str, shape: tuple):
        """Whole while the client optimizer is built; ZeRO's flat partitions are read after
        deepspeed.initialize (`_adopt_zero_muon`)."""
        from parallel.engine.model.optim.muon import MuonRefused

        if self.dims.tp > 1:
            raise MuonRefused(f"optimizer: torch.optim.Muon over {name} at topology.tp "
                              f"{self.dims.tp} on DeepSpeed: AutoTP splits the matrices into plain "
                              "tensors whose split Muon's layouts do not read; not built. Use "
                              "backend: fsdp (FSDP2 reads TP's DTensors) (docs/optimizers.md)")
        if self.spec.offload != "none":
            raise MuonRefused(f"optimizer: torch.optim.Muon over {name} with offload: "
                              f"{self.spec.offload}: the offloaded partitions are stepped on the "
                              "CPU, away from the process group that gathers each matrix; set "
                              "offload: none (DeepSpeed's own Muon refuses offload too)")
        return None

    def _adopt_zero_muon(self, zero, client) -> None:
        """Every torch.optim.Muon member over ZeRO's flat partitions (backends/deepspeed/muon.py)."""
        from backends.deepspeed.muon import zero_layouts
        from parallel.engine.model.optim.muon import MuonStep, replace_step
        from parallel.engine.model.optim.several import members

        for member in members(client):
            if isinstance(member, torch.optim.Muon):
                ids = {id(g) for g in member.param_groups}
                replace_step(member, MuonStep(member, zero_layouts(zero, ids, client.param_groups)))
                self.say("torch.optim.Muon over ZeRO's flat partitions: polyshard gathers each "
                         "matrix at an owner rank, not DeepSpeed's MuonWithAuxAdam, whose update "
                         "differs (norm + 1e-7 where torch clamps at eps; its 'gram' kernel) "
                         "(docs/optimizers.md)")

    def _scheduled_optimizer(self):
        # ZeRO's wrapper is no torch Optimizer (LambdaLR rejects it); it reads the lr from the
        # client optimizer's param_groups, so the scheduler drives that one.
        inner = getattr(self.optimizer, "optimizer", None)
        return inner if isinstance(inner, torch.optim.Optimizer) else self.optimizer

    def _backward(self, share):
        # The share is weighed already (DeepSpeed would divide by gradient_accumulation_steps
        # again). It counts micro-steps in step(): step() is called after every micro-batch and only
        # updates at the accumulation boundary.
        self.ds.backward(share, scale_wrt_gas=False)
        if not self.ds.is_gradient_accumulation_boundary():
            self.ds.step()

    def _skip_step(self):
        # DeepSpeed must still see the step boundary (its micro-step counters). ZeRO finds the
        # non-finite gradient norm and drops the update and the gradients itself; a plain optimizer
        # (ZeRO-0) skips every parameter whose grad is None.
        if not is_zero(self.optimizer):
            for p in self.ds.module.parameters():
                p.grad = None
        self._ds_step()
        return None

    def _ds_step(self) -> None:
        # a pipeline engine refuses step() ("Only train_batch() is accessible"): its schedule's own
        # update instruction, which the step's schedule left out (pipe.py)
        if self.pipeline is not None:
            self.ds._exec_optimizer_step()
        else:
            self.ds.step()

    def _optimizer_step(self):
        norm = None
        plain = not self.ds.zero_optimization() and self.spec.compute == "fp32"
        if self.pipeline is not None:  # every stage's gradients, clipped (pipe_config.py)
            norm = clip_grad_norm(self.model.parameters(), self.spec.grad_clip,
                                  self.pipeline.layout.group)
        elif plain and not self.spec.grad_clip:
            # Plain data parallel in fp32 records no norm; the gradients are reduced (AutoTP's
            # shards: their squares summed over the TP group, one scalar all-reduce).
            params = list(self.ds.module.parameters())
            norm = (self.split.grad_norm(params) if self.split else
                    torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        skipped = self.ds.skipped_steps
        self._ds_step()
        if plain and self.spec.grad_clip and self.pipeline is None:
            norm = self.ds.clipped_norm  # the one DeepSpeed's clipping just computed
        recorded = self.ds.get_global_grad_norm()
        if recorded is not None:  # a tensor under ZeRO: kept on the device until someone asks
            norm = (recorded.detach().clone() if isinstance(recorded, torch.Tensor)
                    else torch.tensor(recorded))
        return norm, self.ds.skipped_steps == skipped

    # Three layouts of fp32 master weights: flat partitions linked to each parameter (ZeRO-1/2/3,
    # the bf16 optimizer), one fp32 copy per parameter (FP16_UnfusedOptimizer, ZeRO-0 with bf16 or
    # fp16), or the parameters themselves (ZeRO-0 fp32, the client optimizer): one path each.
    def _save_model_optim(self, sink: Sink) -> None:
        sharded, split = self.spec.state_dict == "sharded", self.split
        if is_zero(self.optimizer) and sharded:
            # each rank writes the ranges its partition holds, in place: O(model / N) per rank
            ps.save_state(sharded_state(self.ds, split, self.live), sink)
        elif is_zero(self.optimizer):  # full: rank 0 writes everything, gathered one at a time
            ps.save_state(zero_state(self.ds, lambda i: self.is_main, split=split), sink)
        elif master_names(self.ds) or split is not None:  # ZeRO-0: whole on every dp rank
            state = unfused_state(self.ds) if master_names(self.ds) else plain_state(
                self.ds, self.optimizer)
            save_per_parameter(sink, state, split, sharded, self.is_main)
        else:  # ZeRO-0 in fp32; under pp the stage's view, named as the model is
            write_model_optim(sink, self._named, self.optimizer, sharded, self.rank,
                              on_cpu=self.device.type == "cpu", splits=self.splits)

    def _load_model_optim(self, path: Path, manifest: dict, weights_only: bool = False) -> None:
        self.live.clear()
        if is_zero(self.optimizer):  # whatever wrote it: each rank reads its ranges in place
            load_sharded(self.ds, path, self.split, weights_only)
        elif master_names(self.ds):
            load_unfused(self.ds, path, self.split, weights_only)
        elif self.split is not None:
            load_plain(self.ds, self.optimizer, path, self.split, weights_only)
        else:
            read_model_optim(path, self._named, self.optimizer, weights_only, self.splits)

    @property
    def _named(self):
        """The module under the model's names: DeepSpeed's, or under pp the view over the stage
        (PipelineModule names its layers by index)."""
        return self.model if self.pipeline is not None else self.ds.module

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

    def _data_parallel_group(self):
        """AutoTP's data-parallel group, the one ZeRO reduces over (no torch DeviceMesh of our own:
        its flattened-mesh cache outlives the process group, measured in a second job)."""
        from deepspeed.utils import groups

        return super()._data_parallel_group() if self.dims.tp == 1 else \
            groups.get_data_parallel_group()

    @property
    def forward_gathers(self) -> bool:  # only ZeRO-3 partitions the parameters a forward uses
        return STAGES[self.spec.shard] == 3

    @contextmanager
    def _unwrapped(self):
        # DeepSpeed does not wrap the modules: ZeRO-3's hooks on them gather in any forward, and
        # transformers' generate keeps ranks in step where it sees ZeRO-3
        if self.spec.shard != "full":
            yield self.ds.module
            return
        with zero3_visible(self.config):
            yield self.ds.module

    def _destroy_process_group(self) -> None:
        # DeepSpeed keeps the groups it made (AutoTP's TP and data-parallel groups, its clone of the
        # world) in module globals; torch's teardown leaves them pointing at destroyed groups, and
        # the next job in this process failed in them (measured: "Group ... is not registered").
        # deepspeed.comm's teardown releases them too.
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()
        pdist.forget_meshes()  # the engine's mesh, as the base hook forgets it

    def _forget_groups(self) -> None:
        # the references deepspeed.comm's teardown releases, without destroying the group: a
        # ZeRO engine after an AutoTP one in the same process read its model-parallel size from
        # them and failed (measured: "'NoneType' object has no attribute 'get_model_parallel_rank'")
        from deepspeed.utils import groups

        groups._release_process_group_references(group=None)

    def native_checkpoint(self):
        """(save, load) as DeepSpeed's docs do it: engine.save_checkpoint / load_checkpoint."""
        return (lambda path: self.ds.save_checkpoint(str(path)),
                lambda path: self.ds.load_checkpoint(str(path)))

    def gather_model(self) -> dict:
        if is_zero(self.optimizer):
            return zero_state(self.ds, lambda i: True, with_optimizer=False, split=self.split)["model"]
        model = (unfused_state(self.ds)["model"] if master_names(self.ds) else
                 {ps.clean_name(k): v.detach().cpu() for k, v in self._named.state_dict().items()})
        return model if self.split is None else self.split.state({"model": model},
                                                                 self.split.whole)["model"]

    def _release(self) -> None:
        # ZeRO-3 prefetches the next parameters after each forward (generate's last one included):
        # those all-gathers are waited on and released here, while the process group lives, not
        # left to interpreter teardown (gloo work freed there aborts the process: seen once in CI)
        if self.ds is not None and self.spec.shard == "full":
            self.ds.empty_partition_cache()


def make_engine(spec: Spec, **context) -> Engine:
    import_deepspeed()  # before anything else imports it: without mlflow (library.py)
    return DeepSpeedEngine(spec, **context)
