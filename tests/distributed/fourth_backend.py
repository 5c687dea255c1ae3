"""A fourth backend, defined outside polyshard: plain data parallel (every rank holds the whole model,
gradients summed over ranks), a descriptor and an engine of ~40 lines, saving and loading through the
portable format. tests/unit/test_fourth_backend.py registers it and runs validate / explain / plan /
a step; tests/distributed/test_added_backend.py trains it at 2 ranks and resumes its checkpoint on
FSDP2 (and FSDP2's on it), matching one process."""

import torch
import torch.distributed as dist
from torch import nn

from parallel.checkpoint.state.dcp_state import read_model_optim, write_model_optim
from parallel.descriptor import BackendDescriptor, Capabilities, PlanModel, Unsupported
from parallel.engine.core.engine import Engine
from parallel.spec.errors import SpecError
from parallel.kits.sizes import numel


class ReplicaEngine(Engine):
    """Plain data parallel: the model as is on every rank, the optimizer over its parameters."""

    name = "replica"

    def _prepare(self, model, optimizer):
        model = model() if not isinstance(model, nn.Module) else model
        self._record_params(model)
        return model, self._optimizer_over(optimizer, model)

    def _optimizer_step(self):
        if dist.is_initialized() and dist.get_world_size() > 1:
            # the mean over ranks, as DDP and FSDP reduce: the engine weighs each rank's loss so
            # that the mean of the ranks' gradients is one process's. A sum (this backend until
            # #41) trained the same (Adam is blind to a constant factor) with moments world-size
            # times FSDP2's, so a move between them was off at the step after (2.6e-5)
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(dist.get_world_size())
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              self.spec.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, True

    def _save_model_optim(self, sink):  # whole tensors every rank holds: DCP writes each once
        write_model_optim(sink, self.model, self.optimizer, self.spec.state_dict == "sharded",
                          self.rank, on_cpu=self.device.type == "cpu")

    def _load_model_optim(self, path, manifest, weights_only=False):
        read_model_optim(path, self.model, self.optimizer, weights_only)


def translate(spec) -> dict:
    if spec.offload != "none":
        raise SpecError([("offload", f"{spec.offload!r}: replica keeps everything on the device; "
                          "use offload: none")])
    return {"engine": "ReplicaEngine", "clip": spec.grad_clip}


def _states(spec, shapes, n, low, opt):
    return 4.0 * numel(shapes), 4.0 * numel(shapes), float(opt * numel(shapes))


DESCRIPTOR = BackendDescriptor(
    name="replica", summary="plain data parallel, nothing sharded (a test's backend)",
    capabilities=Capabilities(unsupported={"shard": {
        s: Unsupported("replica shards nothing", "shard: none")
        for s in ("full", "grad_op", "optimizer", "hybrid", "hybrid_grad_op")}}),
    translate=translate, engine="fourth_backend:ReplicaEngine",
    plan=PlanModel(model_states=_states, comm=lambda spec, psi, output_share=0.0, root_share=0.0: 2.0))
