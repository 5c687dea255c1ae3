"""`checkpoint.async_writer: process`: each rank's async saves are written by a process of its own.

A thread in the training process shares its interpreter lock: DCP's planning, torch.save's
serialisation and the hashing hold it in slices the steps beside the write wait for (torch's
`AsyncCheckpointerType.PROCESS` exists for this). The writer, `python -m parallel.checkpoint.background.writer
FD PID`, is started at the first async save and kept until `close`; it talks to its rank over a
socket pair and joins the other writers in a gloo group through the job's store (nothing listens).

Per save one `PendingSave` (finishing.py) crosses, pickled at the save with every staged tensor a
reference into the rank's `HostPool` segments (memory files the writer maps once: no byte copied or
sent again), and sent once the copies have landed. Private traffic between a process and its child.

Not torch's process executor (`dcp.async_save(async_checkpointer_type=PROCESS)`): it runs `dcp.save`
alone (a checkpoint here is also the hashes, manifest, rename and `latest`), keeps its process in a
module global, opens a new TCPStore on every interface on a free port, and starts with
multiprocessing's spawn, which imports the user's `__main__` again (a script without a main guard
would train in it). This writer reuses the job's store and imports only the checkpoint package.

The writer dies with its rank (PR_SET_PDEATHSIG: a crashed rank leaves a `.partial` directory and
`latest` where it was), ignores the job's signals (preemption is the rank's) and leaves at EOF.
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch

from parallel.checkpoint.background.staging import PoolPickler, PoolUnpickler

_HEAD = struct.Struct("!QI")  # payload bytes, memory files sent with it
MAX_FDS = 250  # Linux passes at most 253 descriptors in one message (SCM_MAX_FD)


class WriterDied(RuntimeError):
    """The rank's checkpoint writer process ended without answering."""


class WriterProcess:
    """The rank's side: starts the writer, hands it each save, waits for its answer."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, rank: int):
        self.proc, self.sock, self.rank = proc, sock, rank
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="polyshard-writer-send")
        self._sent: Future | None = None
        self.died: WriterDied | None = None  # later saves refused with it (the group lost one)

    @classmethod
    def start(cls, rank: int, timeout_s: float) -> WriterProcess:
        """Collective on the first async save: the writers' rendezvous is agreed (one broadcast)."""
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        init = {"rank": rank, "world": world, "timeout_s": timeout_s,  # before anything starts
                "store": _rendezvous() if world > 1 else None}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = str(Path(__file__).resolve().parents[2])  # where `parallel` is importable from
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "parallel.checkpoint.background.writer", str(theirs.fileno()),
             str(os.getpid())], pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        _send(ours, pickle.dumps(init))  # read once the writer has imported torch; we go on
        return cls(proc, ours, rank)

    def pack(self, job, pool) -> tuple[bytes, list[int]]:
        """`job` pickled (its staged tensors by reference into `pool`), with the memory files
        the writer has not mapped yet: (message, their descriptors)."""
        if self.died is not None:
            raise WriterDied(f"{self.died} (at an earlier save); async saves cannot go on in this "
                             "job: save synchronously (async_save=False) or restart it")
        fresh, buf = sorted(pool.fresh), io.BytesIO()
        PoolPickler(buf, pool).dump(job)
        message = pickle.dumps({"segments": [(i, pool.segments[i].nbytes()) for i in fresh],
                                "dropped": sorted(pool.dropped), "job": buf.getvalue()})
        pool.fresh, pool.dropped = set(), set()
        return message, [pool.fds[i] for i in fresh]

    def submit(self, packed: tuple[bytes, list[int]], landed: Future | None = None) -> None:
        """Hand a packed save over, sent once `landed` (its copies), from a thread: it waits for
        the copies, the writer's start and a large message. Returns at once."""
        self._sent = self._sender.submit(_send, self.sock, *packed, landed)

    def wait(self) -> None:
        """The save in flight is published; its error raised here."""
        sent, self._sent = self._sent, None
        if sent is None:
            return
        try:
            sent.result()
            outcome = pickle.loads(_recv(self.sock)[0])
        except (EOFError, OSError) as err:
            try:
                code = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                code = None
            self.died = WriterDied(f"rank {self.rank}'s checkpoint writer process (pid "
                                   f"{self.proc.pid}) ended without finishing the save (exit code "
                                   f"{code}); that checkpoint is incomplete and `latest` was not "
                                   "moved")
            raise self.died from err
        if outcome is not None:
            raise outcome

    def stop(self) -> None:
        """EOF: the writer leaves its process group and exits."""
        self._sender.shutdown(wait=True)
        self.sock.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _rendezvous() -> tuple[str, int, str]:
    """(host, port, key prefix) the writers meet at: the job's TCPStore, under a prefix rank 0
    draws for this set of writers (a restarted job's writers never read an earlier set's keys)."""
    import uuid

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        raise RuntimeError(f"checkpoint.async_writer: process joins the ranks' writers through the "
                           f"job's TCPStore, and this job's store is a {type(store).__name__}; "
                           "set checkpoint.async_writer: thread")
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)  # once a job, on its default group
    return store.host, store.port, f"polyshard/writers/{token[0]}/"


def _send(sock: socket.socket, payload: bytes, fds=(), landed: Future | None = None) -> None:
    if landed is not None:
        landed.result()  # the segments hold the save's state: the writer may read them
    if len(fds) > MAX_FDS:
        raise RuntimeError(f"an async save queued {len(fds)} new staging segments at once "
                           f"(at most {MAX_FDS})")
    socket.send_fds(sock, [_HEAD.pack(len(payload), len(fds))], list(fds))
    sock.sendall(payload)


def _recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, _HEAD.size, MAX_FDS)
    if not head:
        raise EOFError
    head += _exactly(sock, _HEAD.size - len(head))
    size, _ = _HEAD.unpack(head)
    return _exactly(sock, size), fds


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError
        got += k
    return bytes(buf)


# ---- the writer process ----
def _die_with(parent: int) -> None:
    """SIGKILL when the rank that started us dies (Linux); already gone: leave now."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def _join(init: dict) -> None:
    """The writers' own gloo process group, through the job's store."""
    import torch.distributed as dist

    if init["store"] is None:
        return
    host, port, prefix = init["store"]
    timeout = timedelta(seconds=init["timeout_s"])
    store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False, timeout=timeout))
    dist.init_process_group("gloo", store=store, rank=init["rank"], world_size=init["world"],
                            timeout=timeout)


def _outcome(err: BaseException, rank: int) -> bytes:
    """The error pickled for the rank to raise, the writer's traceback in its notes."""
    err.add_note(f"(in rank {rank}'s checkpoint writer process)\n" + "".join(
        traceback.format_exception(err)))
    try:
        return pickle.dumps(err)
    except Exception:  # noqa: BLE001 - an error that does not pickle: its text
        return pickle.dumps(RuntimeError("".join(traceback.format_exception(err))))


def serve(sock: socket.socket) -> None:
    """Take saves until EOF: map new segments, run the save, answer None or the error."""
    import torch.distributed as dist

    init = pickle.loads(_recv(sock)[0])
    segments: dict[int, torch.UntypedStorage] = {}
    joined: BaseException | None = None
    try:
        _join(init)
    except Exception as err:  # noqa: BLE001 - answered to every save: the rank raises it
        joined = err
    try:
        while True:
            try:
                payload, fds = _recv(sock)
            except EOFError:
                return
            try:
                message = pickle.loads(payload)
                for i in message["dropped"]:  # freed by the rank: its pages go with our mapping
                    segments.pop(i, None)
                for (i, nbytes), fd in zip(message["segments"], fds):  # mapped once, kept
                    segments[i] = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", True,
                                                                 nbytes)
                    os.close(fd)
                job = PoolUnpickler(io.BytesIO(message["job"]), segments).load()
                if joined is not None:
                    raise joined
                job.run()
                answer = pickle.dumps(None)
            except Exception as err:  # noqa: BLE001 - the rank raises it
                answer = _outcome(err, init["rank"])
            _send(sock, answer)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str]) -> None:
    fd, parent = int(argv[0]), int(argv[1])
    _die_with(parent)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the job's signals are the rank's to act on
    torch.set_num_threads(1)
    serve(socket.socket(fileno=fd))


if __name__ == "__main__":
    main(sys.argv[1:])
