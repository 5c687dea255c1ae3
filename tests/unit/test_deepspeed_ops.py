"""DeepSpeed's just-in-time ops (backends/deepspeed/runtime/ops.py): a killed build's lock is refused naming
the file and the fix, a build in progress is waited for, and a first build is said with its time."""

import os
from pathlib import Path

import pytest

from backends.deepspeed.runtime import ops


def test_a_lock_no_process_holds_is_refused_naming_it(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as cpp

    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()  # what a killed build leaves: the file, held open by nobody
    if hasattr(cpp, "FileLock"):  # torch 2.15: the file stays and blocks nothing; torch's lock is free
        ops.check_locks(tmp_path)
        with cpp.FileLock(str(lock), timeout=5):
            pass
        monkeypatch.delattr(cpp, "FileLock")  # torch 2.9's FileBaton: the check runs
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


@pytest.mark.parametrize("chosen", [True, False])
def test_the_extension_root_is_where_torch_builds(tmp_path, monkeypatch, chosen):
    """torch's own choice of the build directory is the oracle: TORCH_EXTENSIONS_DIR itself when
    set (our checks looked in a python / CUDA folder under it, where torch never builds)."""
    from torch.utils import cpp_extension

    if chosen:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    else:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path))
    built = cpp_extension._get_build_directory("polyshard_probe", verbose=False)
    assert ops.extension_root() / "polyshard_probe" == Path(built)
