"""torch's Flight Recorder, read for the hang report (hang.py). torch records every process group's
collectives as they are enqueued and complete (2,000 entries a rank by default, TORCH_FR_BUFFER_SIZE;
gloo records its own, NCCL its own): the count costs the hot path nothing polyshard adds. When a
collective fails, each reporting rank reads its record once, so the report says which collective of
which group each rank reached, the number torch gave it, not only where its Python stands.

torch 2.15's own analyzer (`python -m torch.distributed.flight_recorder.fr_trace`) stops with a
KeyError on gloo's dumps (their pg_config is keyed '' where the entries name group '0'; measured):
the status per group is read here directly, from the JSON dump."""

from __future__ import annotations

import json

import torch


def flight_status() -> dict[str, dict] | None:
    """{group: {"enqueued": the last collective's number, "completed": the last completed one's,
    "op": the newest entry's op and input sizes}} from this rank's Flight Recorder; None where this
    torch keeps none or the dump fails (the report is best effort)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    try:
        data = json.loads(dump())
    except Exception:  # noqa: BLE001 - no recorder (disabled, or an older torch): no status
        return None
    newest = {}
    for entry in data.get("entries") or []:  # oldest first: the last one per group wins
        newest[str(entry["process_group"][0])] = entry
    out = {}
    for group, status in (data.get("pg_status") or {}).items():
        entry = newest.get(str(group))
        op = f"{entry['profiling_name']} {entry['input_sizes']}" if entry else "none recorded"
        out[str(group)] = {"enqueued": int(status["last_enqueued_collective"]),
                           "completed": int(status["last_completed_collective"]), "op": op}
    return out


def stuck_group(status: dict[str, dict] | None) -> str | None:
    """The group whose newest collective this rank enqueued and has not completed (the one it
    waits in), else None."""
    waiting = [g for g, s in (status or {}).items() if s["enqueued"] > s["completed"]]
    return max(waiting, key=lambda g: status[g]["enqueued"]) if waiting else None


def positions(mine: dict | None, reports: dict[int, dict]) -> tuple[str, dict[int, str]]:
    """(this rank's place: 'collective #N of group G (op)', or ''; {rank: 'its last on group G:
    #M'} for each reporting rank that recorded the group)."""
    group = stuck_group(mine)
    if group is None:
        return "", {}
    s = mine[group]
    theirs = {r: f"its last collective on group {group}: #{e['collectives'][group]['enqueued']}"
              for r, e in reports.items()
              if group in (e.get("collectives") or {})}
    return f"collective #{s['enqueued']} of group {group} ({s['op']})", theirs
