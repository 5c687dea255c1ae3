"""A backend added from outside (fourth_backend.py, registered at run time) trains at 2 ranks to one
process's losses, resumes its own checkpoints exactly, and moves weights to and from FSDP2 through the
portable format."""

import pytest
import torch
from shared import job, read

from parallel.toy import build_llama, llama_config

pytestmark = pytest.mark.distributed
BUDGET_S = 40  # seconds in make test (tests/conftest.py)


def reference() -> list[float]:
    torch.manual_seed(0)
    model = build_llama(llama_config("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (5, 4, 16), generator=torch.Generator().manual_seed(1))
    out = []
    for s in range(5):
        loss = model(input_ids=ids[s], labels=ids[s]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(loss))
    return out


PAIRS = (("replica", "replica"), ("replica", "fsdp"), ("fsdp", "replica"))


def shared_jobs(tmp):
    """Each backend saves (phase 1), then each pair's loader resumes in fresh processes (phase
    2), in the suite's shared launches (shared.py)."""
    saves = [job("fourth_worker", ["save", b, tmp / f"{b}-ckpt", tmp / f"save-{b}.json"], 2)
             for b in dict.fromkeys(first for first, _ in PAIRS)]
    loads = [job("fourth_worker", ["load", then, tmp / f"{first}-ckpt",
                                   tmp / f"load-{first}-{then}.json"], 2, phase=2)
             for first, then in PAIRS]
    return saves + loads


@pytest.fixture(scope="module")
def runs(shared):
    """{(saved by, loaded by): steps 1-3 then 4-5}."""
    tmp, run = shared[__name__]
    out = {(first, then): read(tmp / f"save-{first}.json", run, "fourth_worker") +
           read(tmp / f"load-{first}-{then}.json", run, "fourth_worker")
           for first, then in PAIRS}
    return out, reference()


def _diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.timeout(600)
def test_a_fourth_backend_trains_resumes_and_moves_weights_both_ways(runs):
    got, ref = runs
    assert _diff(got["replica", "replica"], ref) <= 1e-5, (got["replica", "replica"], ref)
    for pair, losses in got.items():  # step 4's loss: the weights each side loaded are exact
        assert _diff(losses[:4], ref[:4]) <= 1e-5, (pair, losses, ref)


@pytest.mark.timeout(600)
def test_a_fourth_backend_moves_optimizer_state_exactly(runs):
    got, ref = runs
    for pair in (("replica", "fsdp"), ("fsdp", "replica")):
        assert _diff(got[pair], ref) <= 1e-5, (pair, got[pair], ref)
