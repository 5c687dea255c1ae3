"""Parameters by name across sharding (parallel/engine/model/params.py): tied weights survive a
device move, param
groups built before prepare are switched onto the sharded parameters, the param_groups hook groups by
the model as built, and an optimizer that does not hold every trainable parameter exactly once is
refused with the names."""

import pytest
import torch
from torch import nn

from parallel.engine.model.params import OptimizerMismatch, ParamPlan, per_parameter, retie, tied_groups


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def sharded_copy(model):
    """What FSDP2 / XLA do to parameters: every module gets new Parameter objects (ties broken)."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = nn.Parameter(p.detach().clone(), p.requires_grad)
    return model


def test_retie_restores_a_tie_a_device_move_broke():
    model = Tied()
    groups = tied_groups(model)
    assert groups == [["embed.weight", "head.weight"]]
    sharded_copy(model)
    assert model.head.weight is not model.embed.weight
    retie(model, groups)
    assert model.head.weight is model.embed.weight


def test_groups_built_before_prepare_are_switched_by_name():
    model = Tied()
    decay = [model.embed.weight, model.body.weight]
    no_decay = [model.body.bias]
    plan = ParamPlan(model)
    sharded_copy(model)
    optimizer = plan.optimizer(lambda _: torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]), per_parameter(model))
    held = [[id(p) for p in g["params"]] for g in optimizer.param_groups]
    assert held == [[id(model.embed.weight), id(model.body.weight)], [id(model.body.bias)]]
    assert optimizer.param_groups[1]["weight_decay"] == 0.0


def test_param_groups_hook_sees_full_shapes_and_names():
    model = Tied()
    seen = []

    def hook(named):
        seen.extend((n, tuple(p.shape)) for n, p in named)
        return [{"params": [n for n, p in named if p.dim() >= 2]},
                {"params": [n for n, p in named if p.dim() < 2], "lr": 0.5}]

    plan = ParamPlan(model, hook)
    assert ("embed.weight", (10, 4)) in seen and ("head.weight", (10, 4)) not in seen  # tied once
    sharded_copy(model)
    optimizer = plan.optimizer(lambda groups: torch.optim.SGD(groups, lr=0.1), per_parameter(model))
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 1]
    assert optimizer.param_groups[1]["lr"] == 0.5 and optimizer.param_groups[0]["lr"] == 0.1


def test_a_forgotten_trainable_parameter_is_refused_naming_it():
    model = Tied()
    plan = ParamPlan(model)
    with pytest.raises(OptimizerMismatch, match=r"body.bias.*never be updated"):
        plan.optimizer(lambda _: torch.optim.SGD([model.embed.weight, model.body.weight], lr=1),
                       per_parameter(model))


def test_frozen_parameters_may_be_left_out_but_not_held_twice():
    model = Tied()
    model.body.requires_grad_(False)
    plan = ParamPlan(model)
    plan.optimizer(lambda _: torch.optim.SGD([model.embed.weight], lr=1), per_parameter(model))
    optimizer = torch.optim.SGD([model.embed.weight], lr=1)
    optimizer.param_groups.append({**optimizer.param_groups[0], "params": [model.embed.weight]})
    with pytest.raises(OptimizerMismatch, match="more than one place"):
        plan.switch(optimizer, per_parameter(model))


def test_a_tensor_from_elsewhere_is_refused():
    model = Tied()
    plan = ParamPlan(model)
    stray = nn.Parameter(torch.zeros(3))
    with pytest.raises(OptimizerMismatch, match=r"shape \(3,\) that is not a parameter"):
        plan.optimizer(lambda _: torch.optim.SGD([stray, *model.parameters()], lr=1),
                       per_parameter(model))


def test_groups_may_not_split_a_flat_tensor():
    model = Tied()
    plan = ParamPlan(model, lambda named: [{"params": ["embed.weight"]},
                                           {"params": ["body.weight", "body.bias"]}])
    flat = nn.Parameter(torch.zeros(64))
    sharded = [(flat, ["embed.weight", "body.weight"]), (nn.Parameter(torch.zeros(4)), ["body.bias"])]
    with pytest.raises(OptimizerMismatch, match="one flat tensor"):
        plan.optimizer(lambda groups: torch.optim.SGD(groups, lr=1), sharded)
