"""Adding a backend is one descriptor and its package: a fourth, dummy backend defined here (a
single-process engine) goes through validate, explain, plan and a training step with no change to
polyshard itself."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel import registry
from parallel.cli.main import main
from parallel.descriptor import BackendDescriptor, Capabilities, PlanModel, Unsupported
from parallel.engine.base import Engine
from parallel.spec.io import SpecError, load_spec
from parallel.tools.plan import model_states, numel, plan


class SingleProcessEngine(Engine):
    """Plain data parallel of one: the model as is, the optimizer over its parameters."""

    name = "solo"

    def _prepare(self, model, optimizer):
        model = model if isinstance(model, nn.Module) else model()
        self._record_params(model)
        return model, self._optimizer_over(optimizer, model)

    def _optimizer_step(self):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                              self.spec.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, True

    def _save_model_optim(self, sink):
        raise AssertionError("not used here")

    def _load_model_optim(self, path, manifest):
        raise AssertionError("not used here")


def solo_translate(spec) -> dict:
    if spec.world_size != 1:
        raise SpecError([("topology.procs_per_node", "solo runs one process")])
    return {"engine": "SingleProcessEngine", "clip": spec.grad_clip}


SOLO = BackendDescriptor(
    name="solo", summary="one process, no sharding (a test's backend)",
    capabilities=Capabilities(unsupported={"shard": {s: Unsupported("solo shards nothing",
                                                                    "shard: none")
                                                     for s in ("full", "grad_op", "optimizer",
                                                               "hybrid", "hybrid_grad_op")}}),
    translate=solo_translate, engine=f"{__name__}:SingleProcessEngine",
    plan=PlanModel(model_states=lambda spec, shapes, n, low, opt: (4.0 * numel(shapes),
                                                                     4.0 * numel(shapes),
                                                                     float(opt * numel(shapes))),
                   comm=lambda spec, psi: 0.0))


@pytest.fixture
def solo():
    registry.register(SOLO)
    yield SOLO
    registry.unregister("solo")
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_registered_backend_validates_explains_plans_and_trains(solo, tmp_path, capsys):
    spec_file = tmp_path / "solo.yaml"
    spec_file.write_text("backend: solo\nshard: none\ngrad_clip: 1.0\n")
    assert main(["validate", str(spec_file)]) == 0
    assert main(["explain", str(spec_file)]) == 0
    assert '"engine": "SingleProcessEngine"' in capsys.readouterr().out
    # its rules and capabilities are the spec's validation
    assert "solo shards nothing" in str(pytest.raises(SpecError, load_spec,
                                                      {"backend": "solo", "shard": "full"}).value)
    assert "one process" in str(pytest.raises(SpecError, load_spec, {
        "backend": "solo", "shard": "none", "topology": {"procs_per_node": 2}}).value)
    spec = load_spec(spec_file)
    shapes = [(4, 3), (3,)]
    assert sum(model_states(spec, shapes)) == (4 + 4 + 8) * 15
    rows, _ = plan(spec, shapes, None, world=1, seq=8)
    assert ("solo", "none") in {(r.backend, r.shard) for r in rows}
    engine = registry.create_engine(spec)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine.prepare(model, (torch.optim.SGD, {"lr": 0.1}), loss_fn=lambda m, b: m(b[0]).pow(2).mean())
    before = model.weight.detach().clone()
    result = engine.train_step((torch.randn(1, 3),))
    assert result.step == 1 and result.loss > 0 and not torch.equal(model.weight, before)
    assert main(["validate", str(spec_file), "--set", "backend=sollo"]) == 2
    assert "did you mean 'solo'" in capsys.readouterr().err
