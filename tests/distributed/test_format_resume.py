"""A checkpoint written by format version 1 (tests/fixtures/ckpt-v1: FSDP2, one rank) resumes on this
polyshard's FSDP2 and ZeRO-3 at two ranks with the loss the writer saw next, to fp32 tolerance."""

import json

import pytest
from harness import ROOT, needs_both, torchrun

pytestmark = pytest.mark.distributed
BUDGET_S = 30  # seconds in make test (tests/conftest.py)

FIXTURE = ROOT / "tests" / "fixtures" / "ckpt-v1"


@needs_both
@pytest.mark.timeout(600)
def test_a_version_1_checkpoint_resumes_on_today_s_backends(tmp_path):
    torchrun(2, [str(ROOT / "tests" / "distributed" / "format_worker.py"), "--fixture", str(FIXTURE),
                 "--out", str(tmp_path / "out.json")], timeout=500)
    got = json.loads((tmp_path / "out.json").read_text())
    expected = json.loads((FIXTURE.parent / "ckpt-v1.json").read_text())["losses"][2]
    for name, r in got.items():
        assert r["format"] == 1 and r["step"] == 2, (name, r)
        assert abs(r["loss"] - expected) < 1e-5, (name, r["loss"], expected)
