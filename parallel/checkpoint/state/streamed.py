"""A portable state written by several writers from one process, one writer's part in memory at a
time: what a streaming import does with a source checkpoint's rank files (`polyshard ckpt import`
never holds the whole model: docs/checkpoint-format.md, "Import and export").

DCP's save is three steps, which a multi-rank save runs on every rank at once: each writer plans
its items (metadata only), the coordinator makes the global plan (deduplication, the index), then
each writer writes its data. Here the writers are a source checkpoint's ranks: `part(i)` builds
writer i's state (its shards as FlatRange blocks of the whole tensors, chunks.py) for planning, is
dropped, and is built again to write, so memory holds one part, never the model; readers map their
files (torch.load mmap), so the planning pass reads no tensor's bytes (measured: a
torch.load of a DeepSpeed optimizer file holds reference cycles, so a part is collected explicitly
before the next is built; without it two parts were alive at once). Files carry writer
i's prefix (`__i_`), as they would from rank i; the one `.metadata` indexes them all.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from parallel.checkpoint.state.chunks import RangeSavePlanner
from parallel.heap import young_heap
from parallel.checkpoint.state.portable import STATE_DIR, _quiet_dcp, as_written
from parallel.checkpoint.state.sink import Sink
from parallel.checkpoint.state.state_files import RecordingWriter, no_zip_crc


def in_parts(items: list, nbytes: Callable[[object], int], budget: int) -> list[list]:
    """`items` in order, cut where a part would pass `budget` bytes (an item larger than the budget:
    a part of its own); [[]] for no items."""
    parts: list[list] = [[]]
    used = 0
    for item in items:
        size = nbytes(item)
        if parts[-1] and used + size > budget:
            parts.append([])
            used = 0
        parts[-1].append(item)
        used += size
    return parts


class Streamed:
    """A state in `writers` parts: `part(i)` -> writer i's portable state (a rank's shards and
    ranges; whole tensors and param_groups in one part only), built on demand."""

    def __init__(self, part: Callable[[int], dict], writers: int):
        self.part, self.writers = part, writers


def write_streamed(streamed: Streamed, sink: Sink) -> None:
    """DCP's save of every part into sink.tmp/state, one part in memory at a time (each built
    twice: once to plan, once to write)."""
    with young_heap():  # the collections after each part scan that part, not every module
        _write_parts(streamed, RecordingWriter(sink, sink.tmp / STATE_DIR))


def _write_parts(streamed: Streamed, writer: RecordingWriter) -> None:
    writer.reset()
    writer.set_up_storage_writer(True)
    planners, plans = [], []
    with _quiet_dcp(), no_zip_crc():
        for i in range(streamed.writers):
            planner = RangeSavePlanner()
            planner.set_up_planner(as_written(streamed.part(i)), writer.storage_meta(),
                                   is_coordinator=i == 0)
            plans.append(writer.prepare_local_plan(planner.create_local_plan()))
            planner.state_dict = None  # the plan keeps sizes and offsets, no data
            planners.append(planner)
            gc.collect()  # a loaded part holds reference cycles: freed now, not with the next
        plans, metadata = planners[0].create_global_plan(plans)
        plans = writer.prepare_global_plan(plans)  # writer i's files: __i_N.distcp
        results = []
        for i, (planner, plan) in enumerate(zip(planners, plans)):
            planner.set_up_planner(as_written(streamed.part(i)), writer.storage_meta(),
                                   is_coordinator=i == 0)
            results.append(writer.write_data(planner.finish_plan(plan), planner).wait())
            planner.state_dict = None
            gc.collect()
        writer.finish(metadata, results)
