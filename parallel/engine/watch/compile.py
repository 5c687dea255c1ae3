"""Did torch.compile run? (compile.enabled, parallel/engine/model/compile.py applies it)

During the first `PROBE_STEPS` steps each compiled module's call is bracketed by a probe that sees
whether the counting backend's counter moved. A module whose calls ran no graph ran eagerly (the silent
failure of regional compilation in accelerate#4188): the engine warns once, naming it. Then the probes
come off; what remains per step is comparing how many graphs the backend has compiled (a list's
length) to catch recompiles that keep coming, and per graph call the counter's integer add (the graphs
dynamo cached keep their wrapper). Nothing here touches the device or a collective.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from parallel.spec.compiling import Compile

PROBE_STEPS = 2  # step 1 compiles; step 2 may compile once more (guards on step-1 state)


class _Probe:
    """Wraps one compiled module's call during the first steps: did any compiled graph run inside?"""

    def __init__(self, call, tally: Counter, backend):
        self.call, self.tally, self.backend = call, tally, backend

    def __call__(self, *args, **kwargs):
        before = self.backend.runs
        out = self.call(*args, **kwargs)
        self.tally["compiled" if self.backend.runs > before else "eager"] += 1
        return out


@dataclass
class CompileStats:
    """What torch.compile did in this process since prepare."""

    units: int  # modules compiled
    ran_compiled: int  # of those, how many ran a compiled graph during the probed steps
    eager: list[str]  # names of those that ran eagerly on every probed call
    frames: int  # frames dynamo looked at (those it compiled and those it skipped)
    graphs: int  # graphs the backend compiled
    graph_breaks: int  # graph breaks dynamo recorded
    recompiles: int  # graphs compiled again for a frame compiled before (a guard failed)
    late_graphs: int  # graphs compiled after the probed steps (the steady state should have none)
    compile_s: float  # seconds spent in the backend (forward and backward graphs)
    breaks: dict[str, int] = field(default_factory=dict)  # reason (first line) -> count

    def row(self) -> dict:
        return {"compiled": f"{self.ran_compiled}/{self.units}", "graphs": self.graphs,
                "breaks": self.graph_breaks, "recompiles": self.recompiles,
                "compile_s": round(self.compile_s, 2)}


class CompileWatch:
    """Probes the compiled modules for the first steps, then watches for graphs compiled late.
    `loud`: this process warns (one per job is enough: every rank compiles the same code)."""

    def __init__(self, units: list[tuple[str, nn.Module]], backend,
                 section: Compile, loud: bool):
        from torch._dynamo.utils import counters

        self.counters, self.backend, self.section, self.loud = counters, backend, section, loud
        # dynamo's counters are per process: another engine in it may have compiled before this one
        self.base_frames, self.base_breaks = counters["frames"]["total"], Counter(counters["graph_break"])
        self.tallies = {name: Counter() for name, _ in units}
        self.units = units
        for name, module in units:
            module._compiled_call_impl = _Probe(module._compiled_call_impl, self.tallies[name],
                                                backend)
        self.probing, self.warm_graphs, self.warned = True, None, set()

    def after_step(self, step: int) -> None:
        """Called at the end of every step: a length and a comparison, host-only."""
        if self.probing:
            if step >= PROBE_STEPS:
                self._end_probe()
            return
        late = len(self.backend.compiles) - self.warm_graphs
        if late > self.section.max_recompiles:
            self._warn("late", f"torch.compile compiled {late} graph(s) after step {PROBE_STEPS} "
                       f"(compile.max_recompiles: {self.section.max_recompiles}); latest: "
                       f"{self.backend.compiles[-1].frame}. Each costs a compile and usually means "
                       "a shape or a Python value changes between steps: run with "
                       "TORCH_LOGS=recompiles to see the guard")

    def _end_probe(self) -> None:
        for _, module in self.units:  # back to the compiled call itself: nothing left per call
            module._compiled_call_impl = module._compiled_call_impl.call
        self.probing, self.warm_graphs = False, len(self.backend.compiles)
        stats = self.stats()
        if stats.graph_breaks:
            top = sorted(stats.breaks.items(), key=lambda kv: -kv[1])[:3]
            self._warn("breaks", f"torch.compile: {stats.graph_breaks} graph break(s) in steps "
                       f"1-{PROBE_STEPS}, {stats.graphs} graphs; the code between them ran eagerly. "
                       f"Most frequent: {'; '.join(f'{n}x {r}' for r, n in top)}")
        if stats.eager:
            self._warn("eager", f"torch.compile: {len(stats.eager)} of {len(self.units)} compiled "
                       f"module(s) ran eagerly in steps 1-{PROBE_STEPS}: "
                       f"{', '.join(stats.eager[:8])}. Dynamo skipped them (a recompile limit, an "
                       "unsupported construct or a disabled frame): run with "
                       "TORCH_LOGS=graph_breaks,recompiles")

    def _warn(self, kind: str, message: str) -> None:
        if self.loud and kind not in self.warned:
            self.warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def stats(self) -> CompileStats:
        breaks = Counter()
        mine = Counter(self.counters["graph_break"]) - self.base_breaks  # this engine's only
        for reason, n in mine.items():  # one line, addresses dropped
            breaks[re.sub(r" at 0x[0-9a-f]+", "", reason.strip().splitlines()[0])] += n
        compiles = self.backend.compiles
        return CompileStats(
            units=len(self.units), ran_compiled=sum(1 for t in self.tallies.values() if t["compiled"]),
            eager=[n for n, t in self.tallies.items() if t["eager"] and not t["compiled"]],
            frames=self.counters["frames"]["total"] - self.base_frames, graphs=len(compiles),
            graph_breaks=sum(breaks.values()),
            recompiles=sum(c.again for c in compiles),
            late_graphs=0 if self.warm_graphs is None else len(compiles) - self.warm_graphs,
            compile_s=sum(c.seconds for c in compiles), breaks=dict(breaks))


