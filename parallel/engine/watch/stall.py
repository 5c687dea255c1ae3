"""A collective one rank entered alone, named while it still waits (docs/reliability.md, "Hangs").

hang.py names the ranks that are elsewhere when a collective the engine runs times out. A collective
a user's code runs between steps is outside the engine's guard: rank 0 alone reloading a model with
`from_pretrained` under ZeRO-3, or a `dist.barrier()` inside `if rank == 0:`, waits there until the
process group's timeout and then fails with torch's own message, which names neither the collective
nor where the other ranks are. Each engine of 2+ ranks therefore runs one sampler thread: every
`period` seconds it looks at the main thread's innermost frames (no collective, no store traffic,
nothing per step). When the main thread has stood in the same torch.distributed call for half of
`timeout_s`, it wakes every rank's hang watcher (hang.collect_reports) and reports, on stderr and in
a hang-report file: the call, where the user's code made it, and which ranks are not in it and
where they are. The watchers report once per job, so this is said once; a timeout after it is then
named by the rank that collected.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

DIST_DIR = "/torch/distributed/"
C10D = "/torch/distributed/distributed_c10d.py"


@dataclass(frozen=True)
class InCollective:
    """Where a thread stands in torch.distributed: the API it called (`api`), the caller outside
    torch.distributed (`caller`), and the frame's identity while the call lasts (`key`)."""

    api: str
    caller: str
    key: tuple


def in_collective(frame) -> InCollective | None:
    """The torch.distributed call `frame`'s stack stands in, if any: of the innermost run of frames
    in torch/distributed/, its outermost distributed_c10d.py function (broadcast_object_list, not
    the broadcast it calls), and the first frame beyond that run (the caller)."""
    api = None
    while frame is not None and DIST_DIR in frame.f_code.co_filename.replace("\\", "/"):
        if frame.f_code.co_filename.replace("\\", "/").endswith(C10D) and \
                not frame.f_code.co_name.startswith("_"):
            api = frame
        frame = frame.f_back
    if api is None:
        return None
    caller = "?" if frame is None else (
        f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
    return InCollective(api.f_code.co_name, caller, (id(api), api.f_lasti))


class StallWatch:
    """The sampler thread: `report(where, waited_s)` once, when the main thread has stood in one
    torch.distributed call for `limit_s`. `close()` stops it (the engine's close)."""

    def __init__(self, limit_s: float, report, main: threading.Thread | None = None):
        self.limit_s, self.report = limit_s, report
        self.period = min(30.0, max(0.25, limit_s / 4))
        self.main = main or threading.main_thread()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="polyshard-stall-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        seen, since = None, 0.0
        while not self._stop.wait(self.period):
            where = in_collective(sys._current_frames().get(self.main.ident))
            now = time.monotonic()
            if where is None or seen is None or where.key != seen.key:
                seen, since = where, now
                continue
            if now - since >= self.limit_s:
                self.report(where, now - since)
                return

    def close(self) -> None:
        self._stop.set()


def stall_text(rank: int, where: InCollective, waited_s: float, timeout_s: float,
               reports: dict[int, dict] | None, world: int, named: int = 8) -> str:
    """What a stalled rank says: its call, and the ranks not in it (their progress and frames)."""
    head = (f"rank {rank} has waited {waited_s:.0f} s in torch.distributed.{where.api} (called at "
            f"{where.caller}), half of timeout_s {timeout_s:g} s")
    if reports is None:
        return head + "; the job's store is unreachable, so where the other ranks are is unknown"
    inside = [r for r, e in reports.items() if e.get("collective") == where.api]
    elsewhere = [f"rank {r} at '{e['progress']}' ({e['frames']})"
                 for r, e in sorted(reports.items()) if e.get("collective") != where.api]
    silent = [r for r in range(world) if r not in reports]
    parts = elsewhere[:named] + ([f"{len(elsewhere) - named} more"] if len(elsewhere) > named
                                 else [])
    if silent:
        parts.append(f"{len(silent)} rank(s) sent no report (exited, or stuck outside Python): "
                     f"{silent[:named]}")
    if not parts:
        return head + f"; all {len(inside)} ranks are in it: a slow collective, not a missing peer"
    return (head + f"; {len(inside)} of {world} ranks are in it, not: " + "; ".join(parts)
            + ". A collective every rank must enter was entered by these alone")
