"""checkpoint.async_save on FSDP2 and ZeRO-3 at 2 ranks: the checkpoint holds the state of the step
it was taken at although training went on while it was written (a fresh engine resumes from it with
the same losses), a second save waits for the first, `latest` moves to the newest published one, and
save blocks for less time than a synchronous save of the same state (the ratio is reported by
`polyshard bench`, not asserted here)."""

import json

import pytest
from harness import ROOT, needs_both, torchrun
from reliability import record

pytestmark = pytest.mark.distributed


@needs_both
@pytest.mark.timeout(900)
def test_async_save_holds_its_step_while_training_goes_on(tmp_path):
    torchrun(2, [str(ROOT / "tests" / "distributed" / "async_worker.py"), "--root",
                 str(tmp_path / "ckpt"), "--out", str(tmp_path / "out.json")], timeout=800)
    got = json.loads((tmp_path / "out.json").read_text())
    rows = []
    for name, r in got.items():
        assert r["step"] == 3, r
        assert r["latest"] == "async-1", r  # every save published, the last one last
        for ours, theirs in zip(r["resumed"], r["losses"][3:]):
            assert abs(ours - theirs) < 1e-6, (name, r["resumed"], r["losses"])
        rows.append({"backend": name, "sync save s": f"{min(r['sync_save_s']):.3f}",
                     "async save blocks s": f"{min(r['async_blocking_s']):.3f}",
                     "async save total s": f"{min(r['async_total_s']):.3f}"})
    record("checkpoint-async", {"summary": "toy:demo (3.2M parameters, AdamW), 2 ranks: time "
                                "`save` blocks training, sync vs checkpoint.async_save", "rows": rows})
