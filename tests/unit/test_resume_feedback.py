"""`engine.resume()` says what it did (#42): the checkpoint it resumed from, or why it starts fresh (a
mistyped `checkpoint.dir` looked like a first run); a damaged `latest` stops `resume: auto` naming the
newest intact checkpoint and how to resume from it, and `resume: latest_valid` falls back to it by
itself, loudly."""

import pytest
import torch

from parallel import create_engine, load_spec
from parallel.engine.state.resuming import ResumeError
from parallel.toy import build_llama, llama_config


def _engine(root, mode):
    engine = create_engine(load_spec({"backend": "fsdp", "micro_batch_size": 2, "checkpoint": {
        "dir": str(root), "every": 1, "resume": mode}}))
    torch.manual_seed(0)
    engine.prepare(build_llama(llama_config("tiny")), (torch.optim.SGD, {"lr": 0.1}))
    said = []
    engine.say = said.append
    return engine, said


def _train(engine, steps):
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        engine.train_step({"input_ids": ids, "labels": ids})
        engine.maybe_save()


def test_resume_says_what_it_did(tmp_path):
    engine, said = _engine(tmp_path / "typo", "auto")
    try:
        assert engine.resume() is None
        assert "does not exist: starting fresh" in said[-1] and "mistyped" in said[-1], said
        engine.spec.checkpoint.dir = str(tmp_path / "run")
        _train(engine, 3)
        assert engine.resume()["step"] == 3 and "resumed from" in said[-1] and "step 3" in said[-1]
        # a damaged latest: auto names the newest intact one; latest_valid falls back to it
        shard = next((tmp_path / "run" / "step-00000003" / "state").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:-10])
        with pytest.raises(ResumeError, match="step-00000002.*latest_valid"):
            engine.resume()
        engine.spec.checkpoint.resume = "latest_valid"
        # a planted step-00000009 whose manifest claims step 10**18: intact, newest by name, and
        # not ours (name and manifest disagree, keep_last's rule): never the fallback (#65)
        import json
        import shutil

        planted = tmp_path / "run" / "step-00000009"
        shutil.copytree(tmp_path / "run" / "step-00000002", planted)
        manifest = json.loads((planted / "manifest.json").read_text())
        (planted / "manifest.json").write_text(json.dumps({**manifest, "step": 10 ** 18}))
        assert engine.resume()["step"] == 2 and engine.step == 2
        assert any("WARNING" in s and "step-00000003" in s and "falling back" in s for s in said)
    finally:
        engine.close()
