"""Checkpoint writes go through an explicit Sink (parallel/checkpoint/state/sink.py): what one save wrote
and queued is its own, whatever else is in flight, and parallel/checkpoint/ keeps no module-level
mutable state that could route one save's files into another's."""

import ast
import threading
from pathlib import Path

import torch

from parallel.checkpoint.format.directory import begin_checkpoint
from parallel.checkpoint.background.finishing import finish_checkpoint
from parallel.checkpoint.format.manifest import read_manifest
from parallel.checkpoint.state.portable import STATE_DIR, load_state, save_state, write_queued
from parallel.checkpoint.state.sink import Sink
from parallel.checkpoint.background.saver import StagedSink

ROOT = Path(__file__).resolve().parents[2]


def test_two_saves_in_flight_keep_their_own_files_and_queue(tmp_path):
    a = StagedSink(begin_checkpoint(tmp_path / "a", 0))
    b = Sink(begin_checkpoint(tmp_path / "b", 0))
    w = torch.arange(6.0)
    save_state({"model": {"w": w}}, a, collective=False)  # staged: a host copy, no file
    w.add_(100)  # the next "step" changes the live tensor
    save_state({"model": {"w": w}}, b, collective=False)  # written now, in between
    assert a.written == [] and len(a.queued) == 1
    assert b.written and all(str(f).startswith(str(b.tmp)) for f in b.written)
    a.save_file("trainer.pt", {"step": 1})
    done = threading.Thread(target=write_queued, args=(a,))  # the background writer's thread
    done.start()
    done.join()
    assert {f.parent.name for f in a.written} >= {STATE_DIR, a.tmp.name}
    assert not set(a.written) & set(b.written)
    for sink, path, step in ((a, tmp_path / "a", 1), (b, tmp_path / "b", 2)):
        finish_checkpoint(path, sink, 0, {"step": step, "world_size": 1})
        assert read_manifest(path)["step"] == step
    got = {"model": {"w": torch.zeros(6)}}
    load_state(got, tmp_path / "a", collective=False)
    assert torch.equal(got["model"]["w"], torch.arange(6.0))  # what was staged, not the later step


def _mutable_globals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
        value = getattr(node, "value", None)
        mutable = isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp,
                                     ast.SetComp)) or (
            isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("list", "dict", "set", "deque"))
        found += [f"{path.name}:{node.lineno} {ast.unparse(t)}" for t in targets if mutable]
        found += [f"{path.name}:{node.lineno} global" for n in ast.walk(node)
                  if isinstance(n, ast.Global)]
    return found


def test_checkpoint_package_keeps_no_module_level_mutable_state():
    found = [g for f in sorted((ROOT / "parallel" / "checkpoint").glob("*.py"))
             for g in _mutable_globals(f)]
    assert found == [], found
