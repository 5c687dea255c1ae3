"""Checkpoints written by earlier format versions stay readable (tests/fixtures/ckpt-v1: written by
polyshard at format version 1, FSDP2, one rank, toy:tiny, AdamW, 2 steps), and a version this
polyshard does not know is refused naming both versions and what to do."""

import json
import shutil
from pathlib import Path

import pytest

from parallel.checkpoint.state import portable as ps
from parallel.checkpoint.format.manifest import FORMAT_VERSION, READS, verify_checkpoint
from parallel.checkpoint.format.safe import CheckpointError
from parallel.toy import build_llama, llama_config

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt-v1"


def test_every_format_since_1_is_read():
    assert READS == tuple(range(1, FORMAT_VERSION + 1))


def test_the_version_1_fixture_verifies_and_holds_the_whole_model_and_optimizer():
    manifest = verify_checkpoint(FIXTURE)
    assert manifest["format_version"] == 1 and manifest["step"] == 2
    assert len(manifest["files"]) >= 4  # state/.metadata, state/__0_0.distcp, trainer.pt, rng
    model = ps.read_model(FIXTURE)
    expected = build_llama(llama_config("tiny")).state_dict()
    assert {k: tuple(v.shape) for k, v in model.items()} == \
        {k: tuple(v.shape) for k, v in expected.items()}
    keys = ps.stored_keys(FIXTURE)
    assert all(f"optim.state.{n}.exp_avg_sq" in keys for n in
               dict(build_llama(llama_config("tiny")).named_parameters()))


def test_a_corrupted_version_1_file_is_named(tmp_path):
    copy = shutil.copytree(FIXTURE, tmp_path / "v1")
    (copy / "trainer.pt").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match=r"trainer.pt: size 4 bytes"):
        verify_checkpoint(copy)


@pytest.mark.parametrize("version, says", [(FORMAT_VERSION + 1, "written by a newer polyshard"),
                                           ("x", "not a polyshard checkpoint format")])
def test_an_unknown_version_is_refused_naming_both(tmp_path, version, says):
    copy = shutil.copytree(FIXTURE, tmp_path / "future")
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "format_version": version}))
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(copy)
    text = str(err.value)
    assert f"format_version {version!r}" in text and f"writes {FORMAT_VERSION}" in text
    assert says in text, text
