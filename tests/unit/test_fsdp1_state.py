"""FSDP1's sharded checkpoint written from its flat shards in place (backends/fsdp/flat_state.py), at
one rank: the same stored tensors and groups as torch's get_state_dict path wrote, read back into an
engine that had trained and evaluated (its root unit left gathered) with the next loss unchanged, and
optimizer state that is neither per-element nor scalar refused by name; the views one save
built are kept for the next while they are live (LiveFlat). Two ranks, where the ranges
are real parts of each parameter: tests/distributed (parity, transfer matrix, checkpoint memory)."""

import pytest
import torch
from kept_views import assert_same_views

from backends.fsdp import flat_state
from parallel import create_engine, load_spec
from parallel.checkpoint.state import optim_state
from parallel.checkpoint.state import portable as ps
from parallel.checkpoint.state.dcp_state import write_model_optim
from parallel.checkpoint.state.sink import Sink
from parallel.toy import build_llama, llama_config


def engine_for(use_orig_params: bool, seed: int):
    torch.manual_seed(seed)
    model = build_llama(llama_config("tiny", tie_word_embeddings=True))
    engine = create_engine(load_spec({"backend": "fsdp", "micro_batch_size": 2,
                                      "fsdp": {"version": 1, "use_orig_params": use_orig_params}}))
    engine.prepare(model, (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}))
    return engine


def batch(seed: int) -> dict:
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_state_is_torch_s_and_loads_over_a_trained_engine(tmp_path, use_orig_params):
    engine = engine_for(use_orig_params, seed=0)
    other = engine_for(use_orig_params, seed=5)
    try:
        for i in range(2):
            engine.train_step(batch(i))
        engine.evaluate([batch(9)])  # FSDP1 keeps the root unit gathered after this forward
        ours = engine.save(tmp_path / "ours")
        (tmp_path / "torch").mkdir()
        write_model_optim(Sink(tmp_path / "torch"), engine.model, engine.optimizer, True, 0)
        shapes = ps.tensor_shapes(ours)
        assert shapes == ps.tensor_shapes(tmp_path / "torch")
        assert "lm_head.weight" in {k.removeprefix("model.") for k in shapes}  # tied: both names
        mine, theirs = ps.read_tensors(ours, shapes), ps.read_tensors(tmp_path / "torch", shapes)
        assert [k for k in shapes if not torch.equal(mine[k], theirs[k])] == []
        groups = [optim_state.read_groups(p) for p in (ours, tmp_path / "torch")]
        assert [sorted(g["params"]) for g in groups[0]] == [sorted(g["params"]) for g in groups[1]]
        expected = engine.train_step(batch(2)).loss

        other.train_step(batch(7))  # optimizer state and step counts of its own
        other.evaluate([batch(9)])
        other.load(ours)
        assert other.train_step(batch(2)).loss == expected
    finally:
        engine.close()
        other.close()


def test_optimizer_state_of_another_shape_is_refused_by_name():
    engine = engine_for(False, seed=0)
    try:
        engine.train_step(batch(0))
        flat = next(iter(engine.optimizer.state))
        engine.optimizer.state[flat]["row_sums"] = torch.zeros(3)  # factored, as Adafactor keeps
        with pytest.raises(ps.PortableStateError, match="row_sums.*per-element and scalar"):
            flat_state.portable_state(engine.model, engine.optimizer, [], is_main=True)
    finally:
        engine.close()


def assert_fresh(got: dict, engine):
    """`got` is what a fresh portable_state computes now, to the storage its ranges view."""
    now = flat_state.portable_state(engine.model, engine.optimizer, engine.params.tied, True)
    assert_same_views(got, now)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_kept_views_are_what_portable_state_computes_now(use_orig_params):
    """LiveFlat: the views of one save kept for the next while they are live. After steps and an
    lr change they are a fresh portable_state (step counts too); a reallocated state tensor is
    seen."""
    engine = engine_for(use_orig_params, seed=0)
    try:
        engine.train_step(batch(0))
        live = flat_state.LiveFlat()
        first = live.get(engine.model, engine.optimizer, engine.params.tied, True)
        engine.train_step(batch(1))
        for group in engine.optimizer.param_groups:
            group["lr"] = 0.25  # a scheduler between saves
        again = live.get(engine.model, engine.optimizer, engine.params.tied, True)
        name = next(iter(first["optim"]["state"]))
        assert again["model"][name] is first["model"][name]  # kept, not built again
        assert again["optim"]["param_groups"][0]["lr"] == 0.25
        assert_fresh(again, engine)

        param = next(iter(engine.optimizer.state))
        engine.optimizer.state[param]["exp_avg"] = engine.optimizer.state[param]["exp_avg"].clone()
        after = live.get(engine.model, engine.optimizer, engine.params.tied, True)
        assert after["model"][name] is not first["model"][name]
        assert_fresh(after, engine)
    finally:
        engine.close()
