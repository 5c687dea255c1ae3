"""What the kept-views tests share (tests/unit/test_live_shards.py, test_fsdp1_state.py): a portable
state handed out from views kept between saves is the one computed fresh now."""

import torch


def _data(v):
    return getattr(v, "data", v)


def assert_same_views(got: dict, now: dict) -> None:
    """`got` equals `now` (a fresh computation) to the storage its model ranges view: names and
    their order, tensors, optimizer entries in order, groups."""
    assert list(got["model"]) == list(now["model"])
    for k, v in now["model"].items():
        assert _data(got["model"][k]).data_ptr() == _data(v).data_ptr(), k
        assert torch.equal(_data(got["model"][k]), _data(v)), k
    assert list(got["optim"]["state"]) == list(now["optim"]["state"])
    for name, entries in now["optim"]["state"].items():
        assert list(got["optim"]["state"][name]) == list(entries), name  # the same order
        for k, v in entries.items():
            assert torch.equal(_data(got["optim"]["state"][name][k]), _data(v)), (name, k)
    assert got["optim"]["param_groups"] == now["optim"]["param_groups"]
