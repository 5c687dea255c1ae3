"""Each state file's digest is taken from its bytes as DCP writes them (portable.DigestingFileSystem),
so publishing a checkpoint reads nothing back: the recorded entries equal a fresh read's, for one and
several writer threads, DCP's renamed .metadata included; the small files are still read back."""

import pytest
import torch

from parallel.checkpoint.manifest import describe
from parallel.checkpoint.portable import STATE_DIR, save_state
from parallel.checkpoint.sink import Sink


@pytest.mark.parametrize("threads", [1, 3])
def test_digests_taken_while_writing_equal_a_read_back(tmp_path, threads):
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(64, 33, generator=g) for i in range(7)},
             "optim": {"state": {"w0": {"step": torch.tensor(3.0),
                                        "exp_avg": torch.randn(64, 33, generator=g)}},
                       "param_groups": [{"lr": 0.1, "params": ["w0"]}]}}
    sink = Sink(tmp_path, threads=threads)
    save_state(state, sink, collective=False)
    written = sorted(set(sink.written))
    assert {f.name for f in written} >= {".metadata"} and len(written) >= 2
    assert all(f.parent == tmp_path / STATE_DIR for f in written)
    for f in written:  # every state file hashed as it was written, and right
        assert sink.described[f] == describe(f), f
    small = sink.write_text("trainer.json", "{}")
    assert small not in sink.described  # read back at publication (directory.finish_checkpoint)
