"""Hang reports that cost nothing while the job is healthy (docs/reliability.md, "Hangs").

A rank records what it is doing in a Python attribute (the engine's `Progress`): no store write, no
collective. Each engine runs one daemon thread (`HangWatch`, for a process group of 2+ ranks) that
sends a single `wait` on the key HANG to the
job's c10d store and then sleeps inside it: the store holds that one request, so a healthy job sends
the store nothing per step, at any world size. When a collective times out (or loses its peer), the
rank it failed on sets HANG; every live rank's watcher wakes, appends its progress and its main
thread's innermost frames to one key, and the failing rank reads that key once to name the ranks
that are elsewhere. A rank whose process is gone sends nothing: it is named as silent.

A collective the user's own code runs outside the engine's guard, entered by one rank alone, is
named by stall.py's sampler at half of `timeout_s`, through the same reports.

On NCCL jobs the same report is made when a collective raises; a timeout the NCCL watchdog catches
aborts the process instead, and the flight recorder (enabled by `polyshard launch`) dumps every
rank's last collectives.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from parallel.engine.watch.flight import flight_status, positions
from parallel.engine.watch.stall import StallWatch, in_collective, stall_text

HANG = "polyshard/hang"
REPORTS = "polyshard/hang/reports"
REPORTED = "polyshard/hang/reported"
ALL_IN = "polyshard/hang/all_in"  # set by the last watcher to report: no one polls the count
COLLECTOR = "polyshard/hang/collector"  # the first failing rank reads the reports; others name it
GRACE_S = 5.0  # how long the failing rank waits for its peers' reports (live watchers answer in ms)
NAMED = 8  # ranks named one by one in a report; the rest are counted (a report stays readable at 4k ranks)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the spec's timeout_s; names the lagging ranks."""


class Progress:
    """Where this process's training is: set by the engine with plain attribute writes."""

    def __init__(self):
        self.step, self.phase = 0, "before the first step"

    def at(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase

    def describe(self) -> str:
        return f"step {self.step}: {self.phase}" if self.step else self.phase


class HangWatch:
    """The engine's hang reporter: its `progress` (where training is, set with plain attribute
    writes) and, for a process group with more than one rank, one watcher thread that reports it
    when any rank's collective fails."""

    def __init__(self, rank: int, timeout_s: float = 600.0, report_dir: str | None = None):
        """`timeout_s`: the process group's; a call into torch.distributed that has waited half
        of it is reported (stall.py). `report_dir`: where hang-report files go (default: the
        working directory, as the engine's timeout errors write them)."""
        self.rank, self.progress = rank, Progress()
        self.timeout_s, self.report_dir, self.stall = timeout_s, report_dir or os.getcwd(), None
        store = _store()
        if store is None or dist.get_world_size() == 1:
            return
        group = dist.group.WORLD  # one watcher per process group: two would both report for a rank
        if any(getattr(t, "watched_group", None) is group for t in threading.enumerate()):
            return
        self.stall = StallWatch(timeout_s / 2, self._stalled)
        # A clone has its own connection: the main thread's store calls never queue behind the wait.
        thread = threading.Thread(target=_watch, args=(store.clone(), rank, dist.get_world_size(),
                                                       threading.main_thread(), self.progress),
                                  name="polyshard-hang-watch", daemon=True)
        thread.watched_group = group
        thread.start()

    def _stalled(self, where, waited_s: float) -> None:
        """The sampler's report: every rank's place gathered by the first rank to ask for it."""
        collector = _collector(self.rank)
        if collector is not None and collector != self.rank:
            reports, text = None, (f"rank {self.rank} has waited {waited_s:.0f} s in "
                                   f"torch.distributed.{where.api} (called at {where.caller}); "
                                   f"rank {collector} gathered every rank's report")
        else:
            reports = collect_reports()
            text = stall_text(self.rank, where, waited_s, self.timeout_s, reports,
                              dist.get_world_size())
            place, theirs = positions(flight_status(), reports or {})
            if place:  # torch's Flight Recorder: the collective, numbered, and each rank's last
                text += f". This rank is in {place}; " + "; ".join(
                    f"rank {r}: {t}" for r, t in sorted(theirs.items())[:NAMED] if r != self.rank)
        path = write_report(self.report_dir, self.rank, text, reports) if (
            self.report_dir and reports) else None
        print(f"polyshard hang watch: {text}" + (f". Every rank's Python stack: {path}" if path
                                                 else ""), file=sys.stderr, flush=True)

    def close(self) -> None:
        """The sampler stops (the engine's close: its collectives are the job's last)."""
        if self.stall is not None:
            self.stall.close()


def _watch(store, rank: int, world: int, main: threading.Thread, progress: Progress) -> None:
    while True:
        try:
            store.wait([HANG], timedelta(days=1))
            break
        except Exception as err:  # noqa: BLE001 - a day without a hang, or the store went away
            if "timeout" not in str(err).lower():
                return
    try:
        inside = in_collective(_frame(main))
        line = json.dumps({"rank": rank, "progress": progress.describe(), "frames": _stack(main),
                           "stack": "".join(traceback.format_stack(_frame(main))),
                           "collective": inside.api if inside else None,
                           "collectives": flight_status()})  # torch's Flight Recorder (flight.py)
        store.append(REPORTS, line + "\n")
        if store.add(REPORTED, 1) == world:
            store.set(ALL_IN, "1")
    except Exception:  # noqa: BLE001 - the job is ending; the report is best effort
        return


def _frame(thread: threading.Thread):
    return sys._current_frames().get(thread.ident)


def _stack(thread: threading.Thread, depth: int = 2) -> str:
    """The innermost Python frames of `thread`: where its main loop stands right now."""
    frame = _frame(thread)
    if frame is None:
        return "no frames"
    frames = traceback.extract_stack(frame)[-depth:]
    return " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}: {(f.line or '').strip()}"
                      for f in reversed(frames))


def collect_reports(grace_s: float = GRACE_S) -> dict[int, dict] | None:
    """Wake every rank's watcher and read what they were doing: {rank: {progress, frames, stack}};
    None when the job's store cannot be reached (the rank hosting it has exited)."""
    store = _store()
    if store is None:
        return None
    try:
        store.set(HANG, "1")
        try:  # one wait, answered when the last watcher reports (or never: a rank is gone)
            store.wait([ALL_IN], timedelta(seconds=grace_s))
        except Exception:  # noqa: BLE001 - not every rank reported within the grace period
            pass
        text = store.get(REPORTS).decode() if store.check([REPORTS]) else ""
    except Exception:  # noqa: BLE001 - a store that is gone is part of the report
        return None
    out = {}
    for line in text.splitlines():
        entry = json.loads(line)
        out[int(entry["rank"])] = entry
    return out


def _collector(rank: int) -> int | None:
    """The rank that reads the reports: the first whose collective failed. When thousands of ranks
    time out at once, one reader keeps the store's traffic at one report per rank, not one per rank
    per failing rank. None when the store cannot be reached."""
    store = _store()
    if store is None:
        return None
    try:
        if store.add(COLLECTOR, 1) == 1:
            store.set(f"{COLLECTOR}/rank", str(rank))
            return rank
        store.wait([f"{COLLECTOR}/rank"], timedelta(seconds=GRACE_S))
        return int(store.get(f"{COLLECTOR}/rank"))
    except Exception:  # noqa: BLE001 - no answer: this rank collects for itself
        return None


def is_timeout(err: BaseException) -> bool:
    """A collective that gave up waiting, or whose peer went away (gloo: "Timed out", "Connection
    closed by peer"; NCCL: "Watchdog caught collective operation timeout")."""
    text = str(err).lower()
    return any(w in text for w in ("timed out", "timeout", "deadline", "connection closed",
                                   "connection reset", "peer"))


def timeout_error(rank: int, world: int, what: str, timeout_s: float, progress: Progress,
                  report_dir: str | None = None) -> CollectiveTimeout:
    """The error a timed-out collective becomes: the ranks that are elsewhere, and where (`progress`:
    this rank's); with `report_dir`, every reporting rank's whole Python stack goes into one file
    there, named in the error."""
    mine = progress.describe()
    head = (f"rank {rank}: {what}: a collective did not complete (timeout_s {timeout_s:g} s, or a "
            f"peer went away) while this rank was at '{mine}'")
    collector = _collector(rank)
    if collector is not None and collector != rank:
        return CollectiveTimeout(head + f"; rank {collector} gathered every rank's report: see its "
                                 "error and the hang-report file it names")
    reports = collect_reports()
    if reports is None:
        return CollectiveTimeout(head + "; the job's store is unreachable (the rank hosting it, "
                                 "usually rank 0, has exited): see that rank's error")
    # this rank's own watcher reported its record beside the others' (read once, not again here)
    own = (reports.get(rank) or {}).get("collectives")
    place, theirs = positions(own if own is not None else flight_status(), reports)
    head += f", in {place}; " if place else "; "
    lagging = [f"rank {r} last reported '{e['progress']}' at {e['frames']}"
               + (f" ({theirs[r]})" if r in theirs else "")
               for r, e in sorted(reports.items()) if e["progress"] != mine]
    silent = [r for r in range(world) if r not in reports]
    parts = lagging[:NAMED] + ([f"and {len(lagging) - NAMED} more ranks elsewhere"]
                               if len(lagging) > NAMED else [])
    if silent:
        who = f"rank {silent[0]}" if len(silent) == 1 else f"{len(silent)} ranks ({_ranges(silent)})"
        parts.append(f"{who} sent no report: the process exited, or is stuck outside Python")
    text = head + ("; ".join(parts) or "every rank reported the same place: a peer skipped a "
                   "collective the others entered")
    path = write_report(report_dir, rank, text, reports) if report_dir else None
    if path is not None:
        text += f". Every rank's Python stack: {path}"
    if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
        prefix = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/tmp/nccl_trace_rank_")
        text += f"; each rank's last collectives (NCCL flight recorder): {prefix}<rank>"
    return CollectiveTimeout(text)


def write_report(directory: str, rank: int, summary: str, reports: dict) -> Path | None:
    """One file with the summary and every reporting rank's stack, innermost frame last."""
    try:
        path = Path(directory) / f"hang-report-rank{rank}-{int(time.time())}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        body = [summary, ""]
        for r, entry in sorted(reports.items()):
            body += [f"==== rank {r}: {entry['progress']}", entry.get("stack", "").rstrip(),
                     "collectives (torch's Flight Recorder, per group): "
                     f"{json.dumps(entry.get('collectives'))}", ""]
        path.write_text("\n".join(body))
        return path
    except OSError:  # a report that cannot be written must not hide the error itself
        return None


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5": a report about thousands of ranks stays one line."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    return ", ".join(text[:NAMED]) + (" ..." if len(text) > NAMED else "")


def _store():
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None
