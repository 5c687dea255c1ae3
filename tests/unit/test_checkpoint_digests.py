"""Each state file's digest is taken from its bytes as DCP writes them (state_files.DigestingFileSystem),
so publishing a checkpoint reads nothing back: the recorded entries equal a fresh read's, for one and
several writer threads, DCP's renamed .metadata included; the small files are still read back."""

import pytest
import torch

from parallel.checkpoint.format.manifest import describe
from parallel.checkpoint.state.portable import STATE_DIR, save_state
from parallel.checkpoint.state.sink import Sink


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


def _state(n: int = 7, rows: int = 256) -> dict:
    # arange, not random: no float's bytes spell a zip header's signature by chance
    return {"model": {f"w{i}": torch.arange(rows * 33, dtype=torch.float32).reshape(rows, 33) + i
                      for i in range(n)}}


def test_pages_go_to_the_disk_while_the_file_is_written(tmp_path, monkeypatch):
    """Every WRITEBACK_BYTES a durable state file's new range is handed to the kernel's writeback,
    front to back without gaps; the digests stay the bytes' own; a staging copy (durable=False)
    hands nothing."""
    from parallel.checkpoint.state import state_files

    real, calls = state_files.sync_file_range(), []
    assert real is not None  # Linux: the call the writer uses exists

    def recording():
        def call(fd, offset, nbytes, flags):
            calls.append((offset, nbytes, flags))
            return real(fd, offset, nbytes, flags)
        return call

    monkeypatch.setattr(state_files, "sync_file_range", recording)
    monkeypatch.setattr(state_files, "WRITEBACK_BYTES", 16 << 10)
    sink = Sink(tmp_path / "durable")
    save_state(_state(), sink, collective=False)
    size = max(f.stat().st_size for f in sink.written)  # one data file: 7 items of 34 KB
    assert len(calls) >= 5 and calls[-1][0] + calls[-1][1] > size * 0.7, (size, calls)
    assert calls[0][0] == 0 and all(b[0] == a[0] + a[1] for a, b in zip(calls, calls[1:]))
    assert all(n >= 16 << 10 and flags == state_files.SYNC_FILE_RANGE_WRITE for _, n, flags in calls)
    for f in sink.written:
        assert sink.described[f] == describe(f), f
    calls.clear()
    save_state(_state(), Sink(tmp_path / "staging", durable=False), collective=False)
    assert calls == []


def test_state_files_are_written_without_zip_crcs_that_torch_load_never_checks(tmp_path):
    """torch.load ignores a zip record's CRC-32 (a flipped data bit loads: the checkpoint's own
    digests are what catches it), so a save skips computing it; torch's setting is put back."""
    import io

    from torch.utils.serialization import config

    saved = io.BytesIO()
    torch.save(torch.arange(1000.0), saved)
    flipped = bytearray(saved.getvalue())
    flipped[flipped.find(torch.tensor([500.0]).numpy().tobytes()) + 3] ^= 0x40
    assert torch.load(io.BytesIO(bytes(flipped)), weights_only=True)[500] != 500.0  # no refusal

    sink = Sink(tmp_path)
    save_state(_state(2), sink, collective=False)
    assert config.save.compute_crc32 is True
    data = [f for f in sink.written if f.suffix == ".distcp"]
    headers = 0
    for f in data:
        raw = f.read_bytes()
        at = raw.find(b"PK\x03\x04")
        while at >= 0:  # each zip record's local header: its crc-32 at byte 14
            headers += 1
            assert raw[at + 14:at + 18] == b"\0\0\0\0", (f, at)
            at = raw.find(b"PK\x03\x04", at + 4)
    assert headers >= 4
    loaded = {"model": {k: torch.empty_like(v) for k, v in _state(2)["model"].items()}}
    from parallel.checkpoint.state.portable import load_state
    load_state(loaded, tmp_path, collective=False)
    assert all(torch.equal(loaded["model"][k], v) for k, v in _state(2)["model"].items())
