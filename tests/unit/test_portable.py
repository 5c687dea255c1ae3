"""The portable state's pure logic: names, optimizer re-keying, strict loading, XLA v1 layout maths,
`latest` and retention. One process, no launcher (DCP in no_dist mode)."""

import json

import pytest
import torch

from backends.xla.layout import member_ranges, shard_of, split_members
from parallel.checkpoint.format.directory import publish, resolve
from parallel.checkpoint.background.finishing import write_checkpoint
from parallel.checkpoint.state.portable import (
    PortableStateError,
    clean_name,
    load_state,
    read_model,
    save_state,
)
from parallel.checkpoint.state.optim_state import merge_groups, optim_by_name, optim_for_torch


def test_wrapper_parts_are_stripped_from_names():
    assert clean_name("_fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.w") == \
        "model.layers.0.mlp.w"
    assert clean_name("_orig_module.lm_head.weight") == "lm_head.weight"
    assert clean_name("model._fpw_module.norm.weight") == "model.norm.weight"


def trained(opt_cls=torch.optim.AdamW, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = opt_cls(model.parameters(), lr=0.1, **kw)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt, {id(p): n for n, p in model.named_parameters()}


def test_optimizer_state_round_trips_through_names():
    model, opt, names = trained()
    by_name = optim_by_name(opt, names)
    assert set(by_name["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert by_name["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    _, fresh, fresh_names = trained()
    stored = [{**g, "lr": 0.025} for g in by_name["param_groups"]]
    fresh.load_state_dict(optim_for_torch(fresh, by_name["state"], stored, fresh_names))
    assert fresh.param_groups[0]["lr"] == 0.025  # the checkpoint's hyper-parameters win
    for p, q in zip(opt.param_groups[0]["params"], fresh.param_groups[0]["params"]):
        assert torch.equal(opt.state[p]["exp_avg_sq"], fresh.state[q]["exp_avg_sq"])


def test_group_count_mismatch_is_an_error():
    with pytest.raises(PortableStateError, match="2 param groups, this run's 1"):
        merge_groups([{"lr": 1, "params": []}], [{"lr": 1}, {"lr": 2}], [[]])


def test_a_parameter_in_another_group_is_an_error_naming_it():
    stored = [{"lr": 1, "params": ["a", "b"]}, {"lr": 2, "params": ["c"]}]
    merged = merge_groups([{"lr": 5, "params": []}, {"lr": 5, "params": []}], stored,
                          [["a", "b"], ["c"]])
    assert [g["lr"] for g in merged] == [1, 2]
    with pytest.raises(PortableStateError, match=r"b \(group 1 here, group 0 in the checkpoint\)"):
        merge_groups([{"lr": 5}, {"lr": 5}], stored, [["a"], ["b", "c"]])


def save(tmp_path, opt_cls, **kw):
    model, opt, names = trained(opt_cls, **kw)
    state = {"model": dict(model.state_dict()), "optim": optim_by_name(opt, names)}
    save_state(state, tmp_path, collective=False)
    return state


def test_load_refuses_entries_it_has_no_place_for(tmp_path):
    save(tmp_path, torch.optim.SGD, momentum=0.9)
    _, adam, names = trained()
    template = {"optim": {"state": optim_by_name(adam, names)["state"], "param_groups": None}}
    with pytest.raises(PortableStateError, match="momentum_buffer"):
        load_state(template, tmp_path, collective=False)


def test_weights_read_whole_in_one_process(tmp_path):
    state = save(tmp_path, torch.optim.AdamW)
    weights = read_model(tmp_path)
    assert weights.keys() == state["model"].keys()
    assert all(torch.equal(weights[k], state["model"][k]) for k in weights)


def test_xla_v1_shard_maths_is_the_inverse_of_gathering():
    members = [("a", torch.Size([3, 5])), ("b", torch.Size([7]))]  # 22 values, padded to 2 x 16
    tensors = {"a": torch.arange(15.0).view(3, 5), "b": torch.arange(100.0, 107.0)}
    shards = [shard_of(tensors, members, 16, rank) for rank in range(2)]
    assert shards[1][6:].eq(0).all()  # XLA FSDP pads the tail with zeros
    back = split_members(torch.cat(shards), members)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_xla_v1_ranges_of_each_shard_cover_every_member_once():
    members = [("a", torch.Size([3, 5])), ("b", torch.Size([7]))]
    tensors = {"a": torch.arange(15.0).view(3, 5), "b": torch.arange(100.0, 107.0)}
    seen = {name: torch.full((shape.numel(),), -1.0) for name, shape in members}
    for rank in range(2):
        shard = shard_of(tensors, members, 16, rank)
        for name, r in member_ranges(shard, members, rank).items():
            assert seen[name][r.start:r.start + r.data.numel()].eq(-1).all()  # nothing twice
            seen[name][r.start:r.start + r.data.numel()] = r.data
    assert all(torch.equal(seen[k].view(tensors[k].shape), tensors[k]) for k in tensors)


def test_latest_points_at_the_newest_and_keep_last_prunes_by_step(tmp_path):
    for step in (1, 2, 3):
        path = write_checkpoint(tmp_path / f"step-{step}", 0, lambda t: None,
                                {"step": step, "world_size": 1})
        publish(path, keep_last=2, managed=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-2", "step-3"]
    assert resolve(tmp_path) == tmp_path / "step-3"
    assert json.loads((resolve(tmp_path) / "manifest.json").read_text())["step"] == 3


def test_cached_plans_write_this_saves_values_and_a_changed_layout_is_planned_again(tmp_path):
    """DCP's plan caching (#44): a second save of the same layout reuses the cached plan and index
    (checked in torch's cache, and by timing in docs/checkpoint-format.md), with the second save's
    values; a state with another layout under the same key is planned again, not written by the
    cached plan."""
    from torch.distributed.checkpoint.planner import SavePlanner

    from parallel.checkpoint.state.sink import Sink

    sections = ("model",)  # a key of its own: other tests' saves do not touch it
    key = "polyshard:model:1:files"
    SavePlanner._cached_global_plan.pop(key, None)
    first = {"model": {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(4)}}
    second = {"model": {"a": -first["model"]["a"], "b": torch.zeros(4)}}
    other = {"model": {"a": torch.arange(9.0).view(3, 3), "c": torch.full((2,), 7.0)}}
    plans = []
    for i, state in enumerate((first, second, other)):
        save_state(state, Sink(tmp_path / str(i), sections=sections), collective=False)
        plans.append(SavePlanner._cached_global_plan[key])
        weights = read_model(tmp_path / str(i))
        assert weights.keys() == state["model"].keys()
        assert all(torch.equal(weights[k], v) for k, v in state["model"].items()), i
    assert plans[1] is plans[0] and plans[2] is not plans[0]  # reused, then planned again
