"""transformers inside a polyshard ZeRO-3 job sees what runs (hf_tools_worker.py)."""

import json

import pytest
from harness import ROOT, needs_deepspeed, torchrun

pytestmark = pytest.mark.distributed
BUDGET_S = 30  # seconds in make test (tests/conftest.py)


@needs_deepspeed
@pytest.mark.parametrize("zero_init", [pytest.param(False, marks=pytest.mark.full), True])
def test_zero3_is_what_transformers_expects(tmp_path, zero_init):
    import torch
    from transformers import LlamaForCausalLM

    from parallel.toy import build_llama, llama_config

    torch.manual_seed(5)
    build_llama(llama_config("tiny")).save_pretrained(tmp_path / "model")
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = float(LlamaForCausalLM.from_pretrained(tmp_path / "model")(
            input_ids=ids, labels=ids).loss)
    torchrun(2, [str(ROOT / "tests" / "distributed" / "hf_tools_worker.py"), str(tmp_path / "model"),
                 str(tmp_path / "out.json"), "zero_init" if zero_init else "plain"], timeout=240)
    run = json.loads((tmp_path / "out.json").read_text())
    assert run["zero3_seen"] is True, run  # generate(synced_gpus=None) then syncs the ranks
    assert run["outside_unwrap"] is False, run  # only while built and inside unwrap (#64)
    assert abs(run["loss"] - expected) < 1e-5, (run["loss"], expected)  # from_pretrained's weights
    assert run["new_tokens"] == [6, 1], run  # each rank stopped where it stopped, no hang
    assert run["after_close"] is False
