"""torch.optim.Muon's update on sharded matrices is torch's on the whole ones, bitwise
(muon_worker.py): every layout the backends give, three steps, three settings of the
hyper-parameters; 2 ranks in make test's shared launches, the 2 x 2 meshes (FSDP2 over TP's strided
rows, rows and columns, HSDP's replicas) on 4 ranks in make test-full."""

import pytest
from harness import torchrun
from shared import job, read

pytestmark = pytest.mark.distributed
BUDGET_S = 10  # seconds in make test (tests/conftest.py)


def shared_jobs(tmp):
    return [job("muon_worker", ["--out", tmp / "muon.json"], 2)]


def check(results: dict) -> None:
    wrong = {name: error for name, error in results.items() if error}
    assert not wrong, wrong
    assert len(results) >= 9, sorted(results)


def test_muon_update_is_torchs_on_every_two_rank_layout(shared):
    tmp, run = shared[__name__]
    check(read(tmp / "muon.json", run, "muon_worker"))


@pytest.mark.full
@pytest.mark.timeout(300)
def test_muon_update_is_torchs_on_four_rank_meshes(tmp_path):
    from harness import ROOT

    torchrun(4, [str(ROOT / "tests" / "distributed" / "muon_worker.py"), "--out",
                 str(tmp_path / "muon.json")])
    check(read(tmp_path / "muon.json", None, "muon_worker"))
