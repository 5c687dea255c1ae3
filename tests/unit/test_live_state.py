"""LiveState (parallel/checkpoint/state/dcp_state.py): FSDP2's sharded state as torch's get_state_dict gives
it, handed out again while it is still live. After steps and a learning-rate change the reused state
is what torch computes now (names, order, tensors over the same storage, hyper-parameters); a replaced
optimizer tensor and a parameter moved to new storage are seen; an optimizer with a state_dict of
its own is asked at every save; an engine's save after a load holds the loaded state."""

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from parallel import create_engine, load_spec
from parallel.checkpoint.state.dcp_state import LiveState
from parallel.toy import build_llama, llama_config


def engine_for(optimizer=torch.optim.AdamW, seed: int = 0):
    torch.manual_seed(seed)
    engine = create_engine(load_spec({"backend": "fsdp", "micro_batch_size": 2}))
    engine.prepare(build_llama(llama_config("tiny")), (optimizer, {"lr": 1e-2}))
    return engine


def batch(seed: int) -> dict:
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def local(t):
    return getattr(t, "_local_tensor", t)


def assert_torch_s(got, model, optimizer):
    """`got` is what torch's get_state_dict returns now, to the storage its tensors view."""
    msd, osd = get_state_dict(model, optimizer)
    assert list(got[0]) == list(msd)
    for k, v in msd.items():
        assert local(got[0][k]).data_ptr() == local(v).data_ptr() and torch.equal(
            local(got[0][k]), local(v)), k
    assert list(got[1]["state"]) == list(osd["state"])
    for name, state in osd["state"].items():
        assert list(got[1]["state"][name]) == list(state), name
        for k, v in state.items():
            assert torch.equal(local(got[1]["state"][name][k]), local(v)), (name, k)
            assert local(got[1]["state"][name][k]).data_ptr() == local(v).data_ptr(), (name, k)
    assert got[1]["param_groups"] == osd["param_groups"]


def test_the_reused_state_is_what_torch_computes_after_steps_and_an_lr_change():
    engine = engine_for()
    try:
        engine.train_step(batch(0))
        live = LiveState()
        first = live.get(engine.model, engine.optimizer)
        engine.train_step(batch(1))
        for group in engine.optimizer.param_groups:
            group["lr"] = 0.25  # what a scheduler does between saves
        again = live.get(engine.model, engine.optimizer)
        name = next(iter(first[0]))
        assert again[0][name] is first[0][name]  # reused: not detached again
        assert again[1]["param_groups"][0]["lr"] == 0.25
        assert_torch_s(again, engine.model, engine.optimizer)

        param = next(iter(engine.optimizer.state))
        replaced = torch.zeros_like(engine.optimizer.state[param]["exp_avg"])
        engine.optimizer.state[param]["exp_avg"] = replaced  # an optimizer that reallocates
        after = live.get(engine.model, engine.optimizer)
        assert any(s.get("exp_avg") is replaced for s in after[1]["state"].values())
        assert_torch_s(after, engine.model, engine.optimizer)

        weight = local(next(engine.model.parameters()))
        weight.data = weight.data.clone()  # a parameter moved to new storage: recomputed
        assert_torch_s(live.get(engine.model, engine.optimizer), engine.model, engine.optimizer)
    finally:
        engine.close()


class Noting(torch.optim.AdamW):
    """An optimizer whose state_dict says how often it was asked."""

    asked = 0

    def state_dict(self):
        Noting.asked += 1
        out = super().state_dict()
        out["param_groups"][0]["asked"] = Noting.asked
        return out


def test_an_optimizer_with_its_own_state_dict_is_asked_at_every_save():
    engine = engine_for(Noting)
    try:
        engine.train_step(batch(0))
        live = LiveState()
        seen = [live.get(engine.model, engine.optimizer)[1]["param_groups"][0]["asked"]
                for _ in range(2)]
        assert seen[1] > seen[0]
    finally:
        engine.close()


def test_saves_after_a_load_hold_the_loaded_state(tmp_path):
    a, b, c = engine_for(), engine_for(seed=5), engine_for(seed=9)
    try:
        a.train_step(batch(0))
        saved = a.save(tmp_path / "a")
        b.train_step(batch(3))
        b.save(tmp_path / "b")  # b's LiveState holds b's own state now
        b.load(saved)
        again = b.save(tmp_path / "c")  # what b holds after the load: a's state
        c.load(again)
        expected = a.train_step(batch(1)).loss
        assert b.train_step(batch(1)).loss == expected and c.train_step(batch(1)).loss == expected
    finally:
        for e in (a, b, c):
            e.close()
