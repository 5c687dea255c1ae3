"""LiveShards (backends/deepspeed/checkpoint/fragments.py): a ZeRO engine's sharded views kept from
one save to the next. After steps and a learning-rate change, what it hands out is what a fresh sharded_state
computes now, on every ZeRO variant of the registry: names and order, ranges over the same storage,
step counts and hyper-parameters. A replaced optimizer tensor is seen; an engine's save after a load
holds the loaded state."""

import pytest
import torch
from kept_views import assert_same_views

from backends.deepspeed.checkpoint.fragments import LiveShards, sharded_state
from parallel import create_engine, load_spec, registry
from parallel.toy import build_llama, llama_config

ZERO = {n: over for n, over in registry.get("deepspeed").variants.items()
        if over.get("shard", "full") != "none"}


def engine_for(over: dict, seed: int = 0):
    torch.manual_seed(seed)
    engine = create_engine(load_spec({**over, "backend": "deepspeed", "micro_batch_size": 2}))
    engine.prepare(build_llama(llama_config("tiny", tie_word_embeddings=True)),
                   (torch.optim.AdamW, {"lr": 1e-2}))
    return engine


def batch(seed: int) -> dict:
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def assert_fresh(got: dict, ds):
    """`got` is what sharded_state computes now, to the storage its ranges view."""
    assert_same_views(got, sharded_state(ds))


@pytest.mark.parametrize("variant", sorted(ZERO))
def test_kept_views_are_what_sharded_state_computes_now(variant):
    engine = engine_for(ZERO[variant])
    try:
        engine.train_step(batch(0))
        live = LiveShards()
        first = live.get(engine.ds)
        engine.train_step(batch(1))
        for group in engine.ds.optimizer.optimizer.param_groups:
            group["lr"] = 0.25  # a scheduler between saves
        again = live.get(engine.ds)
        name = next(iter(first["optim"]["state"]))
        assert again["model"][name] is first["model"][name]  # kept, not built again
        assert again["optim"]["param_groups"][0]["lr"] == 0.25
        assert_fresh(again, engine.ds)

        base = engine.ds.optimizer.optimizer
        flat = next(iter(base.state))
        base.state[flat]["exp_avg"] = base.state[flat]["exp_avg"].clone()  # reallocated
        after = live.get(engine.ds)
        assert after["model"][name] is not first["model"][name]
        assert_fresh(after, engine.ds)
    finally:
        engine.close()


def test_saves_after_a_load_hold_the_loaded_state(tmp_path):
    # ZeRO-3 (its load also rebuilds the persistent parameters): three engines share this
    # process's group, the first made it and its close ends it, so it closes last
    over = ZERO["zero3"]
    a, b, c = engine_for(over), engine_for(over, seed=5), engine_for(over, seed=9)
    try:
        a.train_step(batch(0))
        saved = a.save(tmp_path / "a")
        b.train_step(batch(3))
        b.save(tmp_path / "b")  # b's LiveShards holds b's own views now
        b.load(saved)
        again = b.save(tmp_path / "c")
        c.load(again)
        expected = a.train_step(batch(1)).loss
        assert b.train_step(batch(1)).loss == expected and c.train_step(batch(1)).loss == expected
    finally:
        for e in (c, b, a):
            e.close()
