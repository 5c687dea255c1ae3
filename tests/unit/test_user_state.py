"""The user's own objects in checkpoints (parallel/engine/state/user_state.py): registered, saved with the
checkpoint, restored on load; what cannot be restored is refused before anything is read."""

import json

import pytest
import torch

from parallel.engine.state.user_state import UserState, host_copy


class Ema:
    def __init__(self):
        self.value, self.steps = torch.zeros(3), 0

    def state_dict(self):
        return {"value": self.value, "steps": self.steps, "note": ["kept", 1.5]}

    def load_state_dict(self, state):
        self.value, self.steps = state["value"], state["steps"]


def test_registration_rules():
    state = UserState()
    assert state.register(Ema()) == "state0"
    with pytest.raises(TypeError, match="has no state_dict"):
        state.register(object())
    with pytest.raises(ValueError, match="is taken"):
        state.register(Ema(), "state0")
    with pytest.raises(ValueError, match="not a plain file name"):
        state.register(Ema(), "../escape")


def test_host_copy_is_detached_from_later_steps():
    value = torch.ones(2)
    copy = host_copy({"v": value, "n": [value]}, "x")
    value += 1
    assert copy["v"].tolist() == [1.0, 1.0] and copy["n"][0].tolist() == [1.0, 1.0]


def test_saved_and_restored_with_the_checkpoint(tmp_path):
    from parallel import create_engine, load_spec
    from parallel.checkpoint.format.safe import UnsafeFileError
    from parallel.toy import build_llama, llama_config

    engine = create_engine(load_spec({"backend": "fsdp", "micro_batch_size": 2}))
    torch.manual_seed(0)
    engine.prepare(build_llama(llama_config("tiny")), (torch.optim.SGD, {"lr": 0.1}))
    shared, mine = Ema(), Ema()
    engine.register_for_checkpointing(shared, "ema")
    engine.register_for_checkpointing(mine, "sampler", per_rank=True)
    shared.value += 2
    shared.steps = mine.steps = 7
    engine.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "user" / "ema.pt").is_file()
    assert (tmp_path / "ckpt" / "user" / "sampler" / "rank0.pt").is_file()
    shared.value.zero_()  # in place: the saved copy must not see it
    shared.steps = mine.steps = 0
    engine.load(tmp_path / "ckpt")
    assert shared.value.tolist() == [2.0, 2.0, 2.0] and shared.steps == 7 and mine.steps == 7
    # registered otherwise than saved: refused naming the object, before anything is read
    engine.user_state = UserState()
    engine.register_for_checkpointing(Ema(), "ema", per_rank=True)
    with pytest.raises(ValueError, match="'ema' was saved shared and is registered per_rank"):
        engine.load(tmp_path / "ckpt")
    manifest = tmp_path / "ckpt" / "manifest.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "user_state": ["../../x"]}))
    with pytest.raises(UnsafeFileError, match="field user_state"):
        engine.load(tmp_path / "ckpt")
    engine.close()
