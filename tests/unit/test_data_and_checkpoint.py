"""The loader resumes where it stopped; checkpoint directories are atomic and verified."""

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from parallel.checkpoint.format.safe import CheckpointError
from parallel.checkpoint.format.manifest import verify_checkpoint
from parallel.checkpoint.background.finishing import write_checkpoint
from parallel.engine.data.resumable import ResumableLoader, ResumableSampler


def loader(rank=0, world=2, batch=2, seed=3):
    data = TensorDataset(torch.arange(22))
    sampler = ResumableSampler(len(data), world, rank, seed)
    return ResumableLoader(DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True),
                           sampler, batch)


def flat(batches):
    return [b[0].tolist() for b in batches]


def test_resume_mid_epoch_continues_with_the_next_unseen_batch():
    whole = flat(list(loader()))  # 11 samples per rank -> 5 batches
    first = loader()
    it = iter(first)
    seen = [next(it) for _ in range(3)]
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    assert flat(seen) + flat(list(resumed)) == whole
    assert (resumed.epoch, resumed.batches_done, len(resumed)) == (1, 0, 5)  # next epoch, whole


def test_ranks_are_disjoint_and_epochs_reshuffle():
    r0, r1 = flat(list(loader(rank=0))), flat(list(loader(rank=1)))
    assert not set(sum(r0, [])) & set(sum(r1, []))
    two = loader()
    assert flat(list(two)) != flat(list(two))  # epoch 1 draws a new permutation


def test_resume_on_another_world_size_continues_the_same_sample_order():
    two = [loader(rank=r) for r in range(2)]
    its = [iter(x) for x in two]
    seen = [flat([next(it) for _ in range(3)]) for it in its]  # 3 steps x 2 ranks x 2 samples
    one = loader(rank=0, world=1, batch=4)
    one.load_state_dict(two[0].state_dict())
    rest = flat(list(one))
    whole = flat(list(loader(rank=0, world=1, batch=2)))  # the epoch's order on one rank
    consumed = [x for step in zip(*seen) for pair in step for x in pair]
    assert sorted(consumed) == sorted(sum(whole[:6], []))  # the same 12 samples, none replayed
    assert sum(rest, []) == sum(whole, [])[12:20]


def test_resume_mid_batch_on_another_layout_is_refused():
    a = loader(batch=2)
    it = iter(a)
    next(it)  # 4 samples consumed over 2 ranks
    with pytest.raises(ValueError, match="does not divide"):
        loader(batch=3).load_state_dict(a.state_dict())


def write(path, payload=b"x" * 1000):
    def files(sink):
        (sink.tmp / "data.bin").write_bytes(payload)
        sink.record(sink.tmp / "data.bin")  # hashed by the rank that wrote it
    return write_checkpoint(path, 0, files, {"step": 7, "world_size": 1})


def test_checkpoint_is_verified_and_corruption_is_named(tmp_path):
    ckpt = write(tmp_path / "ck")
    assert verify_checkpoint(ckpt)["step"] == 7
    data = ckpt / "data.bin"
    data.write_bytes(b"x" * 999)
    with pytest.raises(CheckpointError, match=r"data.bin: size 999 bytes, the checkpoint says 1000"):
        verify_checkpoint(ckpt)
    data.write_bytes(b"x" * 999 + b"y")
    with pytest.raises(CheckpointError, match=r"data.bin: xxh3_128 mismatch"):
        verify_checkpoint(ckpt)
    data.unlink()
    with pytest.raises(CheckpointError, match="listed in the checkpoint's hashes but missing"):
        verify_checkpoint(ckpt)
    data.write_bytes(b"x" * 1000)
    (ckpt / "late.bin").write_bytes(b"?")
    with pytest.raises(CheckpointError, match="late.bin: not listed in the checkpoint's hashes"):
        verify_checkpoint(ckpt)
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest missing"):
        verify_checkpoint(ckpt)


def test_rewrite_replaces_atomically_and_leaves_no_temporaries(tmp_path):
    write(tmp_path / "ck", b"old")
    write(tmp_path / "ck", b"new")
    assert (tmp_path / "ck" / "data.bin").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    hashes = json.loads((tmp_path / "ck" / "hashes" / "rank0.json").read_text())
    assert hashes["data.bin"]["size"] == 3 and manifest["format_version"] == 2
