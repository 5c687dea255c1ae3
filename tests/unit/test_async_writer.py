"""checkpoint.async_save's parts in one process (parallel/checkpoint/background/saver.py, staging.py,
writer.py): the staging pool reused from save to save, DTensors staged as the pieces DCP writes of
them, the hand-over to a writer process by reference into shared memory, its answers and errors, and
a writer that dies with its rank. The 2-rank guarantees (exact resume, `latest`, a writer killed
mid-write) are tests/distributed/test_async_save.py's."""

import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parallel.checkpoint.background.saver import BackgroundSaver, StagedSink
from parallel.checkpoint.state.chunks import FlatRange, RangeSavePlanner, Shards
from parallel.checkpoint.format.directory import partial_path
from parallel.checkpoint.background.finishing import PendingSave
from parallel.checkpoint.format.manifest import read_manifest, verify_checkpoint
from parallel.checkpoint.state.portable import metadata, read_model, save_state
from parallel.checkpoint.state.sink import Sink
from parallel.checkpoint.background.staging import HostPool, PoolPickler, PoolUnpickler, stage

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("shared", [False, True])
def test_the_pool_reuses_its_segments_while_the_state_keeps_its_shape(shared):
    pool = HostPool(shared=shared)
    state = [torch.arange(10.0), torch.ones(3, 5, dtype=torch.bfloat16), torch.tensor(7)]
    first = pool.copies(state)
    pool.finish()
    ptr = pool.segments[0].data_ptr()
    state[0].add_(1)
    second = pool.copies(state)
    pool.finish()
    assert pool.segments[0].data_ptr() == ptr  # no allocation: the same bytes again
    for src, got in zip(state, second):
        assert torch.equal(src, got) and got.dtype == src.dtype
        # exactly its own bytes: DCP writes it without cloning (chunks.exact_view)
        assert got.untyped_storage().nbytes() == got.numel() * got.element_size()
        assert got.data_ptr() % 64 == 0
    assert torch.equal(first[0], second[0])  # the same memory: staged copies are per save
    assert all(a is b for a, b in zip(first, second))  # placed once: the same views again
    state[0] = state[0].view(2, 5)  # the same bytes, another shape: placed again, same segment
    third = pool.copies(state)
    pool.finish()
    assert third[0].shape == (2, 5) and third[0] is not first[0] and torch.equal(third[0], state[0])
    assert pool.segments[0].data_ptr() == ptr
    pool.copies([torch.zeros(4)])  # the state changed: a segment of its size
    pool.finish()
    assert len(pool.segments) == 1 and pool.segments[0].nbytes() == 64
    assert (pool.fds[0] is not None) == shared and (0 in pool.fresh) == shared
    assert pool.dropped == ({0} if shared else set())  # the writer unmaps the old segment 0
    pool.release()
    assert pool.segments == [] and pool.fresh == set()


def test_staged_dtensors_are_the_pieces_dcp_writes_of_them(one_rank):
    from torch.distributed.checkpoint.planner_helpers import _create_write_items
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    d = distribute_tensor(torch.arange(12.0).view(3, 4), mesh, [Shard(0)])
    ranged = FlatRange(torch.arange(5.0), 3, (4, 2))  # elements 3-7 of a 4x2 tensor
    staged = stage({"model": {"w": d, "r": ranged, "n": 3, "groups": [{"lr": 0.1}]}}, HostPool())
    w = staged["model"]["w"]
    assert isinstance(w, Shards) and w.size() == d.size()
    assert w.__create_write_items__("model.w", w) == _create_write_items("model.w", d)
    d.to_local().add_(100)  # a later step: the staged copy keeps the step it was taken at
    (item,) = w.__create_write_items__("model.w", w)
    assert torch.equal(RangeSavePlanner.lookup_object(
        type("P", (), {"state_dict": {"model.w": w}})(), item.index), torch.arange(12.0).view(3, 4))
    r = staged["model"]["r"]
    assert r.__create_write_items__("model.r", r) == ranged.__create_write_items__("model.r", ranged)
    assert staged["model"]["n"] == 3 and staged["model"]["groups"] == [{"lr": 0.1}]
    # kept from save to save by the DTensor's identity, and looked up again for a new dtype
    geometry: dict = {}
    with torch.no_grad():  # as stage calls it: the local tensors themselves
        (chunk, props, data), = Shards.sources(d, geometry)
        (chunk2, props2, data2), = Shards.sources(d, geometry)
        assert (chunk2, props2) == (chunk, props) == w.pieces[0][:2]
        assert data2 is data is d.to_local()
        d._local_tensor = d.to_local().to(torch.float64)
        (_, props64, data64), = Shards.sources(d, geometry)
    assert props64.dtype == torch.float64 and data64 is d._local_tensor and props.dtype == torch.float32


def test_staged_tensors_cross_to_the_writer_by_reference():
    pool = HostPool(shared=True)
    staged = stage({"a": torch.arange(6.0), "b": FlatRange(torch.ones(4), 2, (2, 3)),
                    "rng": torch.arange(3, dtype=torch.uint8),
                    "none": FlatRange(torch.zeros(0, dtype=torch.bfloat16), 0, (2, 3))}, pool)
    pool.finish()
    buf = io.BytesIO()
    PoolPickler(buf, pool).dump(staged)
    assert len(buf.getvalue()) < 2000  # references, not the bytes
    assert b"_rebuild_tensor" not in buf.getvalue()  # none by value (torch's legacy save, 64 us)
    # the writer's side: its own mapping of each segment's memory file
    segments = {i: torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", True, s.nbytes())
                for i, (fd, s) in enumerate(zip(pool.fds, pool.segments))}
    got = PoolUnpickler(io.BytesIO(buf.getvalue()), segments).load()
    assert torch.equal(got["a"], torch.arange(6.0)) and torch.equal(got["rng"], staged["rng"])
    staged["a"].add_(5)  # the same memory, seen through the other mapping
    assert torch.equal(got["a"], torch.arange(6.0) + 5)
    assert got["a"].untyped_storage().nbytes() == 24  # DCP writes it in place
    assert got["b"].__create_write_items__("b", got["b"]) == staged["b"].__create_write_items__(
        "b", staged["b"])
    # a rank's empty range (ZeRO-1/2: a parameter wholly on another rank) by its dtype and shape
    assert got["none"].data.dtype == torch.bfloat16 and got["none"].data.shape == (0,)
    assert got["none"].__create_write_items__("n", got["none"]) == []
    pool.release()


def test_buffers_are_copied_at_once_the_rest_when_the_pool_completes():
    """What the next forward may change (buffers: BatchNorm's statistics) is copied by the save;
    parameters and optimizer state later, on the saver's thread, before the next optimizer step."""
    pool = HostPool()
    param, buffer = torch.arange(4.0), torch.zeros(3)
    staged = stage({"p": param, "b": buffer}, pool, now={buffer.data_ptr()})
    pool.finish()
    assert len(pool.later) == 1  # the parameter's copy: not made yet
    buffer.add_(1)  # the next forward
    assert torch.equal(staged["b"], torch.zeros(3))
    pool.complete()
    assert torch.equal(staged["p"], param) and pool.later == []


def test_the_step_after_an_async_save_waits_for_its_copies_before_updating(tmp_path):
    """save returns before the parameters' and optimizer state's copies are made (they overlap
    the next forward and backward); the next optimizer step waits for them. Here the saver's
    thread is held busy for 1.5 s first, so without that wait the update would reach the
    checkpoint: the resumed run would not repeat the steps after the save."""
    from parallel import create_engine, load_spec
    from parallel.toy import build_llama, llama_config

    def engine(seed):
        torch.manual_seed(seed)
        e = create_engine(load_spec({"backend": "fsdp", "micro_batch_size": 2}))
        e.prepare(build_llama(llama_config("tiny")), (torch.optim.AdamW, {"lr": 1e-2}))
        return e

    def batch(seed):
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(seed))
        return {"input_ids": ids, "labels": ids}

    first, second = engine(0), engine(5)
    try:
        first.train_step(batch(0))
        saver = first.checkpoints.saver
        # the copies land 1.5 s late: the next forward and backward, well under a second even
        # on a busy host (make test's unit lane shares it), are done before them
        saver._stager.submit(time.sleep, 1.5)
        first.save(tmp_path / "ckpt", async_save=True)
        after = [first.train_step(batch(i)).loss for i in (1, 2)]  # at once
        assert saver.staging_wait_s > 0.3  # the first update waited for the copies
        first.wait_for_save()
        second.load(tmp_path / "ckpt")
        assert [second.train_step(batch(i)).loss for i in (1, 2)] == after
    finally:
        first.close()
        second.close()


def _job(path: Path, sink: Sink, step: int) -> PendingSave:
    return PendingSave(path, sink, {"trainer.pt": {"step": step}}, {"step": step, "world_size": 1},
                       0, True, None, None, opened=False)


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_a_background_writer_publishes_and_raises_what_failed(tmp_path, writer):
    saver = BackgroundSaver(writer, timeout_s=60)
    try:
        for step in (1, 2):
            sink = StagedSink(partial_path(tmp_path / f"s{step}"), saver.pinned)
            save_state({"model": {"w": torch.full((5,), float(step))}}, sink, collective=False)
            sink.placed()
            saver.submit(_job(tmp_path / f"s{step}", sink, step))
            saver.wait()
            verify_checkpoint(tmp_path / f"s{step}")
            assert read_manifest(tmp_path / f"s{step}")["step"] == step
            assert torch.equal(read_model(tmp_path / f"s{step}")["w"], torch.full((5,), float(step)))
            assert (tmp_path / "latest").read_text().strip() == f"s{step}"
        assert (saver.writer_pid is not None) == (writer == "process")
        (tmp_path / "blocked").write_text("a file where the checkpoint's parent should be")
        bad = tmp_path / "blocked" / "s3"
        sink = StagedSink(partial_path(bad), saver.pinned)
        sink.placed()
        saver.submit(_job(bad, sink, 3))
        with pytest.raises(NotADirectoryError) as err:
            saver.wait()
        if writer == "process":  # raised in the rank as itself, the writer's traceback noted
            assert "checkpoint writer process" in "".join(err.value.__notes__)
        assert (tmp_path / "latest").read_text().strip() == "s2"
    finally:
        saver.close()
    assert metadata(tmp_path / "s2").state_dict_metadata.keys() == {"model.w"}


RANK = """
import os, signal, sys, time
from pathlib import Path
from parallel.checkpoint.background.saver import BackgroundSaver, StagedSink
from parallel.checkpoint.background.finishing import PendingSave
from parallel.checkpoint.state.sink import Sink

class Busy:  # unpickled in the writer: marks that it is inside the job, then keeps it busy
    def __reduce__(self):
        return exec, (f"open({sys.argv[1]!r}, 'w').close(); import time; time.sleep(60)",)

out, busy = Path(sys.argv[2]), sys.argv[3] == "busy"
saver = BackgroundSaver("process", 60)
saver.submit(PendingSave(out, StagedSink(out.with_name(".ck.partial")), {"x.pt": Busy()},
                         {"step": 1, "world_size": 1}, 0, True, None, None, opened=False))
print(saver.writer_pid, flush=True)
while busy and not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("when", [pytest.param("starting", marks=pytest.mark.full), "busy"])
def test_the_writer_dies_with_its_rank(tmp_path, when):
    """A rank SIGKILLed while its writer starts or is inside a save: the writer goes too (its parent
    check at start; PR_SET_PDEATHSIG), never finishing a checkpoint behind a dead rank's back (the
    busy writer would otherwise sleep 60 s, then write it)."""
    mark = tmp_path / "inside"
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(mark), str(tmp_path / "ck"), when],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pid = int(rank.stdout.readline())
    rank.wait(timeout=60)
    assert rank.returncode == -signal.SIGKILL and mark.exists() == (when == "busy")
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"the writer (pid {pid}) outlived its rank"
    assert not (tmp_path / "ck").exists()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
