"""fsdp.forward_prefetch: each unit prefetches the unit that runs after it in forward, whatever the
wrap policy lists units in (losses cannot show a wrong target: a prefetch only changes timing, so the
targets themselves are asserted). One process, world size 1 (gloo)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallel import create_engine, load_spec


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture
def engine_for():
    made = []

    def make(wrap):
        engine = create_engine(load_spec({"backend": "fsdp", "wrap": wrap,
                                          "fsdp": {"forward_prefetch": True}}))
        made.append(engine)
        return engine

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def _targets(module):
    return [state._modules[0] for state in module._get_fsdp_state()._states_to_forward_prefetch]


@pytest.mark.parametrize("wrap", [{"policy": "size", "min_num_params": 100},
                                  {"policy": "layer_classes", "layer_classes": ["Sequential"]}])
def test_each_unit_prefetches_the_next_unit_in_forward(engine_for, wrap):
    engine = engine_for(wrap)
    torch.manual_seed(0)
    model = engine.prepare(Net(), (torch.optim.SGD, {"lr": 0.1}),
                           loss_fn=lambda m, b: m(b[0]).pow(2).mean())
    names = {id(m): n for n, m in model.named_modules()}
    units = [n for n, m in model.named_modules() if n and hasattr(m, "_get_fsdp_state")]
    forward = sorted(units, key=[n for n, _ in model.named_modules()].index)  # pre-order
    targets = {names[id(m)]: [names[id(t)] for t in _targets(m)] for n, m in model.named_modules()
               if n in units}
    expected = {a: [b] for a, b in zip(forward, forward[1:])}
    assert {k: v for k, v in targets.items() if v} == expected
    engine.train_step((torch.randn(1, 8),))  # and it trains
