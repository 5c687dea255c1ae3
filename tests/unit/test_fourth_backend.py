"""Adding a backend is one descriptor and its package: a fourth backend defined outside polyshard
(tests/distributed/fourth_backend.py: plain data parallel) goes through validate, explain, plan and a
training step with no change to polyshard itself; tests/distributed/test_added_backend.py trains it at
2 ranks and moves its checkpoints to and from FSDP2 through the portable format."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel import registry
from parallel.cli.main import main
from parallel.spec.io import SpecError, load_spec
from parallel.tools.plan import model_states, plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import fourth_backend  # noqa: E402 - defined beside the distributed test that launches it


@pytest.fixture
def replica():
    registry.register(fourth_backend.DESCRIPTOR)
    yield fourth_backend.DESCRIPTOR
    registry.unregister("replica")
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_registered_backend_validates_explains_plans_and_trains(replica, tmp_path, capsys):
    spec_file = tmp_path / "replica.yaml"
    spec_file.write_text("backend: replica\nshard: none\ngrad_clip: 1.0\n")
    assert main(["validate", str(spec_file)]) == 0
    assert main(["explain", str(spec_file)]) == 0
    assert '"engine": "ReplicaEngine"' in capsys.readouterr().out
    # its rules and capabilities are the spec's validation
    assert "replica shards nothing" in str(pytest.raises(SpecError, load_spec,
                                                         {"backend": "replica", "shard": "full"}).value)
    assert "keeps everything on the device" in str(pytest.raises(SpecError, load_spec, {
        "backend": "replica", "shard": "none", "offload": "optimizer"}).value)
    spec = load_spec(spec_file)
    shapes = [(4, 3), (3,)]
    assert sum(model_states(spec, shapes)) == (4 + 4 + 8) * 15
    rows, _ = plan(spec, shapes, None, world=1, seq=8)
    assert ("replica", "none") in {(r.backend, r.shard) for r in rows}
    engine = registry.create_engine(spec)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    engine.prepare(model, (torch.optim.SGD, {"lr": 0.1}), loss_fn=lambda m, b: m(b[0]).pow(2).mean())
    before = model.weight.detach().clone()
    result = engine.train_step((torch.randn(1, 3),))
    assert result.step == 1 and result.loss > 0 and not torch.equal(model.weight, before)
    assert main(["validate", str(spec_file), "--set", "backend=replicaa"]) == 2
    assert "did you mean 'replica'" in capsys.readouterr().err
