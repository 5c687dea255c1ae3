"""Third-party start-up noise, hidden from a launch's output unless `--verbose`.

The workers' stdout and stderr reach ours through a relay that drops whole lines matching NOISE and
passes every other byte on as it arrives. Where our stream is a terminal the workers write to a
pseudo-terminal, so they still see a terminal (rich's live progress bar, colours); otherwise a pipe.
stdout stays stdout and stderr stays stderr (a user's `2> err.log` keeps its meaning).

What is noise, measured on torch 2.9 and torch_xla 2.9: none of it is an error, and none of it can
be turned off by a setting (gloo prints its line whatever TORCH_CPP_LOG_LEVEL says). torch 2.15's
gloo prints no connection lines (measured in make test-full); the XLA lane's torch 2.9 still does.
"""

from __future__ import annotations

import os
import re
import sys
import threading

NOISE = (
    # torchrun's banner when OMP_NUM_THREADS is unset and several processes share a host
    re.compile(rb"^(W\d{4} [\d:.]+ \d+ \S+\] )?\*{20,}\s*$"),
    re.compile(rb"^(W\d{4} [\d:.]+ \d+ \S+\] )?Setting OMP_NUM_THREADS environment variable for "
               rb"each process to be \d+ in default"),
    # XLA's notice on every SPMD compile (torch_xla 2.9): a deprecation of its partitioner
    re.compile(rb"^[\d-]+ [\d:.]+: W external/xla/xla/service/sharding_propagation\.cc:\d+\] GSPMD "
               rb"sharding propagation is going to be deprecated"),
)
# gloo's "[Gloo] Rank R is connected to N peer ranks. Expected number of connected peer ranks is :
# N", once per rank per process group (3 per rank at start-up with FSDP2's mesh). It is written in
# pieces, so ranks sharing a stream interleave them mid-line (measured: "[Gloo] Rank [Gloo] Rank 0
# is connected ..." then "1 is connected ..."): a line made only of its pieces is noise.
GLOO_LITERALS = (b"[Gloo] Rank ", b" is connected to ", b" peer ranks. ", b" peer rank. ",
                 b"Expected number of connected peer ranks is : ")
GLOO_PIECES = re.compile(b"|".join(re.escape(x) for x in GLOO_LITERALS) + rb"|\d+|\s+")


def is_noise(line: bytes) -> bool:
    if any(p.match(line) for p in NOISE):
        return True
    return any(x.strip() in line for x in GLOO_LITERALS) and not GLOO_PIECES.sub(b"", line)


def _may_be_noise(partial: bytes) -> bool:
    """A partial line held back: gloo pieces so far, possibly ending in the start of one."""
    pos = 0
    while (m := GLOO_PIECES.match(partial, pos)) and m.end() > pos:
        pos = m.end()
    rest = partial[pos:]
    return not rest or any(x.startswith(rest) or x.lstrip().startswith(rest)
                           for x in GLOO_LITERALS)


class Relay:
    """One stream: read `fd` until it closes, write what is not noise to `out` (a binary file)."""

    def __init__(self, fd: int, out):
        self.fd, self.out, self.dropped = fd, out, 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:  # a pseudo-terminal whose writers have all gone: EIO, not b""
                chunk = b""
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            kept = [line + b"\n" for line in lines if not self._drop(line)]
            if pending and not _may_be_noise(pending):  # a live bar's redraw: pass it on now
                kept.append(pending)
                pending = b""
            if kept:
                self.out.write(b"".join(kept))
                self.out.flush()
        if pending and not self._drop(pending):
            self.out.write(pending)
            self.out.flush()
        os.close(self.fd)

    def _drop(self, line: bytes) -> bool:
        noisy = is_noise(line.rstrip(b"\r"))
        self.dropped += noisy
        return noisy


def quiet_streams():
    """(child's stdout, child's stderr, start(proc) -> relays): pseudo-terminals where ours are
    terminals, pipes otherwise. Call start after Popen; join the relays after wait."""
    pairs = []
    for ours in (sys.stdout, sys.stderr):
        if ours.isatty():
            import pty

            reader, writer = pty.openpty()
        else:
            reader, writer = os.pipe()
        pairs.append((reader, writer, ours.buffer))

    def start() -> list[Relay]:
        relays = []
        for reader, writer, out in pairs:
            os.close(writer)  # the child holds its copy; EOF comes when the workers exit
            relay = Relay(reader, out)
            relay.thread.start()
            relays.append(relay)
        return relays

    return pairs[0][1], pairs[1][1], start
