"""DeepSpeed's just-in-time ops (backends/deepspeed/ops.py): a killed build's lock is refused naming
the file and the fix, a build in progress is waited for, and a first build is said with its time."""

import os

import pytest

from backends.deepspeed import ops


def test_a_lock_no_process_holds_is_refused_naming_it(tmp_path):
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()  # what a killed build leaves: the file, held open by nobody
    with pytest.raises(RuntimeError) as err:
        ops.check_locks(tmp_path)
    assert str(lock) in str(err.value) and f"rm {lock}" in str(err.value)


def test_a_lock_held_open_is_a_build_in_progress(tmp_path):
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    fd = os.open(lock, os.O_CREAT | os.O_EXCL)  # as torch's FileBaton holds it while building
    try:
        assert ops.held_open(lock) is True
        ops.check_locks(tmp_path)  # no error: another process is building it
    finally:
        os.close(fd)
    assert ops.held_open(lock) is False


def test_a_first_build_is_said_once_with_its_time(tmp_path, monkeypatch):
    monkeypatch.setattr(ops, "extension_root", lambda: tmp_path)
    said = []
    ops.announce_builds(["cpu_adam"], said.append)
    assert len(said) == 1 and "cpu_adam" in said[0] and "44 s" in said[0]
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").touch()
    ops.announce_builds(["cpu_adam"], said.append)
    assert len(said) == 1  # built: nothing to say
