"""topology.ep's token dispatch against one process, block by block (expert_parallel_worker.py), in
the shared 2-rank launch: every Hugging Face mixture-of-experts family it splits gives one process's
outputs and gradients within 1e-6, and an expert no rank routed a token to keeps no gradient on its
owner, as one process leaves it (the optimizer then skips it). topology.ep itself is still refused
at validation (tests/unit/test_dims.py): the engines do not place experts over an ep mesh yet."""

import matrix
import pytest
from shared import job, read

pytestmark = pytest.mark.distributed
BUDGET_S = 5  # seconds in make test (tests/conftest.py): the dispatch rides a shared launch


def fsdp2():
    return next(c for c in matrix.cases(world=2) if c.name == "fsdp2")


def shared_jobs(tmp):
    c = fsdp2()
    return [job("expert_parallel_worker", ["--out", tmp / "ep.json"], 2, c.env)]


def test_each_family_dispatches_to_its_experts_as_one_process_computes(shared):
    tmp, run = shared[__name__]
    ranks = read(tmp / "ep.json", run, "expert_parallel_worker")
    worst = {}
    for rank, found in enumerate(ranks):
        for name, f in found.items():
            assert max(f["output"], f["input_grad"], f["expert_grads"], f["other_grads"]) <= 1e-6, \
                (rank, name, f)
            assert not any("has a grad" in u for u in f["unused"]), (rank, name, f["unused"])
            worst[name] = max(worst.get(name, 0.0), f["output"], f["expert_grads"], f["other_grads"])
    # routing leaves experts idle: the 64-expert top-8 block and DeepSeek's group-limited routing
    assert ranks[0]["deepseek-v3-grouped"]["unused"] or ranks[1]["deepseek-v3-grouped"]["unused"]
    print(f"ep 2, largest difference from one process per block: {worst}")
