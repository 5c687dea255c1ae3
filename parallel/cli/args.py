"""Numbers on the command line: every numeric flag parses through `bounded`, so a value out of range
(`plan --world 0`, `--per-node 0`, `--model inf`, `dryrun --world 10**12`) is argparse's exit 2 naming
the flag, the value and the range, never a traceback from deep inside a command."""

from __future__ import annotations

import argparse
import math

WORLD = 1 << 20  # ranks: the spec's topology bound (parallel/spec/sections.py MAX_WORLD)


def bounded(kind: type, low: float, high: float):
    """An argparse type: an int or a finite float within [low, high]; anything else is argparse's
    exit 2 naming the flag, the value and the range (`plan --world 0`, `--model inf`)."""
    def parse(text: str):
        try:
            value = kind(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{text}: give a value from {low:,} to {high:,}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


COUNT = bounded(int, 1, WORLD)  # ranks, processes, nodes
STEPS = bounded(int, 1, 1 << 24)
SEQ = bounded(int, 1, 1 << 24)  # tokens per sample


def seq_list(text: str) -> list[int]:
    """bench --seq: one length, or a comma-separated sweep (each bounded as SEQ)."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: give tokens per sample, e.g. 64 or 1024,2048")
    return sorted({SEQ(t) for t in parts})


seq_list.__name__ = "tokens"
GBPS = bounded(float, 1e-6, 1e9)
