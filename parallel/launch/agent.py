"""torchrun, reporting a failed job once: which rank failed first, and its error.

Without this, a job whose ranks all raise the same SpecError prints one traceback per rank and then
torchrun's ChildFailedError block with another traceback; the message the user needs is buried.

Worker side (`parallel.dist.install_error_report`, called when a polyshard process starts under a
launcher that gives it an error file): an uncaught exception is written to torchelastic's
per-worker error file
(its usual JSON, plus the exact time and the rank) and, when it is one of polyshard's own errors
(their messages name the field, the cause and the fix), printed as one line instead of a traceback.
Agent side (`python -m parallel.launch.agent TORCHRUN_ARGS`): torchrun's own `run`, with ChildFailedError
turned into a short report of the first failure, and its exit code.
"""

from __future__ import annotations

import sys


def first_failure(failures: dict) -> tuple[int, object, dict]:
    """(global rank, ProcessFailure, our record) of the earliest failure: by the exact time our
    workers recorded, else torchelastic's whole-second timestamp."""
    def when(item):
        rank, failure = item
        mine = (failure.error_file_data or {}).get("polyshard", {})
        return (mine.get("time", float(failure.timestamp)), rank)

    rank, failure = min(failures.items(), key=when)
    return rank, failure, (failure.error_file_data or {}).get("polyshard", {})


def preempted(failures: dict) -> bool:
    """Every rank saved and asked to be requeued: each exited REQUEUE_EXIT, or was ended by this
    agent's SIGUSR2 after one did (torchrun ends the rest once a rank exits; a rank exits
    REQUEUE_EXIT only after the save's closing barrier, so the checkpoint is complete and
    `latest`; measured: on a slow hour rank 1 exited first and rank 0, still in its own exit, was
    ended, 2 runs of 2 in make test)."""
    import signal

    from parallel.engine.watch.preempt import REQUEUE_EXIT

    codes = [f.exitcode for f in failures.values()]
    return REQUEUE_EXIT in codes and all(c in (REQUEUE_EXIT, -signal.SIGUSR2) for c in codes)


def report(failures: dict) -> str:
    from parallel.engine.watch.preempt import REQUEUE_EXIT  # every rank saved and asks to be requeued

    rank, failure, mine = first_failure(failures)
    if preempted(failures):
        return (f"polyshard launch: preempted: the ranks saved a complete checkpoint and exited "
                f"{REQUEUE_EXIT}; requeue the job (the emitted Slurm script does) and it resumes")
    lines = [f"polyshard launch: the job failed; rank {rank} failed first "
             f"({len(failures)} rank(s) failed, exit code {failure.exitcode}):"]
    message = failure.message  # torchelastic's error file nests it: {"message": ..., "extraInfo"}
    message = message.get("message", message) if isinstance(message, dict) else message
    lines += [f"  {line}" for line in str(message).splitlines() or ["(no message)"]]
    if failure.error_file not in ("", "<N/A>"):
        lines.append(f"  traceback: {failure.error_file}")
    return "\n".join(lines)


FORWARDED = ("SIGTERM", "SIGUSR1")  # preemption notices: the workers decide together what to do


def _forward(signum, frame) -> None:  # noqa: ARG001 - the signal module's signature
    """Pass a preemption signal on to this agent's workers instead of killing them: torchrun's own
    SIGTERM handler tears the job down at once (swallowing the notice), and SIGUSR1 would kill the
    agent. The workers catch it (checkpoint.preemption_signals), agree, save and exit 85."""
    import psutil

    for child in psutil.Process().children():
        try:
            child.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def install_forwarding() -> None:
    import signal

    import torch.distributed.elastic.multiprocessing.api as mp_api

    original = mp_api._terminate_process_handler

    def handler(signum, frame):  # torchrun installs this one when it starts the workers
        if signum == signal.SIGTERM:
            return _forward(signum, frame)
        return original(signum, frame)

    mp_api._terminate_process_handler = handler
    # torchrun ends the remaining workers of a failed job with SIGTERM, which the workers now take
    # as a preemption notice (and keep running for up to 30 s): it sends SIGUSR2 instead, whose
    # default action ends a process at once, inside a collective too.
    mp_api._get_default_signal = lambda: signal.SIGUSR2
    for name in FORWARDED:
        signal.signal(getattr(signal, name), _forward)


LOOPBACK = "127.0.0.1"


def loopback_listener(port: int = 0) -> tuple[int, int]:
    """A listening socket on 127.0.0.1 (`port` 0: a free one) for a TCPStore server to own
    (master_listen_fd): (its file descriptor, its port)."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(4096)
    port = sock.getsockname()[1]
    return sock.detach(), port


def listen_on_loopback() -> None:
    """One host (`--standalone`): the stores torchrun's agent serves (the rendezvous store and the
    store it shares with the workers) listen on 127.0.0.1 only. torch's TCPStore server listens on
    every interface (measured: two ports on *:N per launch, unauthenticated, and hang reports travel
    through them); here each server gets a socket already bound to the loopback interface
    (TCPStore's master_listen_fd). Multi-node launches keep torch's behaviour: the other nodes must
    reach the rendezvous (docs/security.md). notebook_launch's ranks call it too: their rank 0
    serves the env:// store of init_process_group."""
    import importlib

    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend

    # the module itself (torch.distributed's attribute `rendezvous` is a function of that name)
    env_rendezvous = importlib.import_module("torch.distributed.rendezvous")
    original = dist.TCPStore

    def loopback_store(host_name, port, *args, is_master=False, **kwargs):
        if is_master and kwargs.get("master_listen_fd") is None:
            fd, port = loopback_listener(port)
            kwargs.update(master_listen_fd=fd, use_libuv=False)  # the store owns it now
        return original(host_name, port, *args, is_master=is_master, **kwargs)

    if getattr(original, "__name__", "") == "loopback_store":
        return  # already in place (a second job in this process)
    # every name torch creates stores through: torchrun's agent, the c10d rendezvous, and env://
    # (init_process_group's rank 0 in a notebook_launch or an in-process job)
    dist.TCPStore = c10d_backend.TCPStore = env_rendezvous.TCPStore = loopback_store


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    if args.standalone:  # workers reach the stores on the loopback interface, where they listen
        args.local_addr = LOOPBACK
        listen_on_loopback()
    install_forwarding()
    try:
        run(args)
    except ChildFailedError as err:
        print(report(err.failures), file=sys.stderr)
        if preempted(err.failures):
            from parallel.engine.watch.preempt import REQUEUE_EXIT

            return REQUEUE_EXIT
        failure = first_failure(err.failures)[1]
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
