"""Where a step's time goes, polyshard's beside the native loop's (`polyshard bench --vs-native
--profile`): each side runs a few untimed steps under `torch.profiler` in the same launch, after the
timed ones. Rank 0 writes both Chrome traces and a table of the operators whose time differs most, so
a ratio above 1.0 is explained by a trace, not by a guess."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

TOP = 25  # rows of the difference table


def _activities():
    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    return acts


def _profiled(step, batches) -> tuple[profile, dict]:
    """Run `step` over `batches` under the profiler; per operator: calls and self CPU time (us),
    averaged per step."""
    # Ranks leave the previous block at different times (building key_averages takes a rank
    # ~1 s): without the barrier the first collective inside would absorb that skew as wait time.
    if dist.is_initialized():
        dist.barrier()
    with profile(activities=_activities(), record_shapes=False) as prof:
        for ids in batches:
            step(ids)
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for evt in prof.key_averages():
        row = ops[evt.key]
        row[0] += evt.count / len(batches)
        row[1] += evt.self_cpu_time_total / len(batches)
        row[2] += evt.cpu_time_total / len(batches)
    return prof, ops


def profile_pair(ours, native, batches, out: Path, rank: int) -> dict | None:
    """Profile both steps (alternating, like the timed run) and, on rank 0, write
    `trace-polyshard.json`, `trace-native.json` and `profile.json` into `out`: per operator the calls
    and self CPU microseconds per step of each side, sorted by the difference."""
    if native is None:
        return None
    _profiled(native, batches[:1]), _profiled(ours, batches[:1])  # warm the profiler itself
    prof_native, theirs = _profiled(native, batches)
    prof_ours, mine = _profiled(ours, batches)
    if rank != 0:
        return None
    out.mkdir(parents=True, exist_ok=True)
    prof_ours.export_chrome_trace(str(out / "trace-polyshard.json"))
    prof_native.export_chrome_trace(str(out / "trace-native.json"))
    rows = []
    for key in set(mine) | set(theirs):
        a, b = mine.get(key, [0, 0, 0]), theirs.get(key, [0, 0, 0])
        rows.append({"op": key, "calls polyshard": round(a[0], 2), "calls native": round(b[0], 2),
                     "self us polyshard": round(a[1]), "self us native": round(b[1]),
                     "self us diff": round(a[1] - b[1])})
    rows.sort(key=lambda r: -abs(r["self us diff"]))
    total = {"self us polyshard": round(sum(v[1] for v in mine.values())),
             "self us native": round(sum(v[1] for v in theirs.values())),
             "steps profiled": len(batches)}
    # The work itself: operators one side calls more often than the other (the timing of the rest is
    # the same work, and differs by host noise).
    extra = [r for r in rows if abs(r["calls polyshard"] - r["calls native"]) >= 0.5]
    report = {"total": total, "ops": rows[:TOP], "calls differ": extra}
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    return report
