"""A one-host job's ranks as plain child processes with what torchrun's agent gives its workers:
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT and the TORCHELASTIC_* variables,
the job's store served by this process (on loopback), and the rule for ending them: the first rank
that fails ends the others (a rank left waiting in a collective for its failed peer would wait out
the collective's timeout).

No agent process: `python -m torch.distributed.run` imports torch before it starts anything (a
two-rank gloo job that only joins and leaves its group took 8 s from start to exit under torchrun on
the 2-core development host, 4 s started here), and a notebook or a test needs no restarts.
`polyshard launch` keeps torchrun's agent: restarts, SIGTERM forwarding and the failure report are
what it is for. The store is this process's for the same reason torchrun's agent keeps it: it
outlives every rank, so a rank that ends first takes nothing from the others (served by rank 0, a
ZeRO-3 job's rank 1 aborted at exit: "terminate called without an active exception").
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def job_ranks(argv: list[str], nproc: int, env: dict[str, str], **popen) -> Iterator[list]:
    """`argv` started `nproc` times, rank r with RANK = LOCAL_RANK = r; `env` is every rank's whole
    environment besides those; `popen`: subprocess.Popen's other arguments (cwd, stdout, ...).
    Leaving the block ends the ranks still running, then the store."""
    import torch.distributed as dist

    from parallel.launch.agent import LOOPBACK, loopback_listener

    fd, port = loopback_listener()  # loopback only: an unauthenticated store (docs/security.md)
    store = dist.TCPStore(LOOPBACK, port, nproc, is_master=True, wait_for_workers=False,
                          master_listen_fd=fd, use_libuv=False)
    shared = {**env, "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port),
              "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
              "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
              "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": f"polyshard-{port}"}
    procs = []
    try:
        for r in range(nproc):
            procs.append(subprocess.Popen(argv, env={**shared, "RANK": str(r),
                                                     "LOCAL_RANK": str(r)}, **popen))
        yield procs
    finally:
        end_ranks(procs)
        del store


def first_failure(procs: list[subprocess.Popen]) -> int | None:
    """The rank that has ended with a non-zero exit code (the lowest), or None."""
    return next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)


def wait_ranks(procs: list[subprocess.Popen], timeout: float | None) -> tuple[int | None, bool]:
    """Wait until every rank has ended, the first failure, or `timeout` seconds; then end the ranks
    still running. (the failed rank or None, whether it timed out)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    late = False
    while any(p.poll() is None for p in procs) and first_failure(procs) is None:
        if deadline is not None and time.monotonic() > deadline:
            late = True
            break
        time.sleep(0.1)
    failed = first_failure(procs)
    end_ranks(procs)
    return failed, late


def end_ranks(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:  # a rank started in a session of its own: its children (a writer process) too
                os.killpg(p.pid, signal.SIGKILL) if os.getpgid(p.pid) == p.pid else p.kill()
            except ProcessLookupError:
                pass
        p.wait()
