"""torch.compile, applied the same way on every backend that runs it, and verified to have run.

Applied: `apply_compile` compiles each module in place (`nn.Module.compile`), so it
keeps its place, name and parameters in the tree: FSDP and DeepSpeed shard or hook it as before, and
checkpoints see the same names. Every compile goes through one backend object (`CountingBackend`)
that wraps each graph it produces so that running it adds one to that backend's counter.

Verified: during the first `PROBE_STEPS` steps each compiled module's call is bracketed by a probe that
sees whether that counter moved. A module whose calls ran no graph ran eagerly (the silent failure of
regional compilation in accelerate#4188): the engine warns once, naming it. Then the probes come off;
what remains per step is comparing how many graphs the backend has compiled (a list's length) to
catch recompiles that keep coming, and per graph call the counter's integer add (the graphs dynamo
cached keep their wrapper). Nothing here touches the device or a collective.
"""

from __future__ import annotations

import re
import sys
import time
import types
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from parallel.engine.wrap import at_unit_places, disable_kv_cache
from parallel.spec.compiling import Compile

PROBE_STEPS = 2  # step 1 compiles; step 2 may compile once more (guards on step-1 state)


@dataclass
class Compiled:
    """One graph the backend compiled."""

    frame: str  # function (file:line), compile id
    again: bool  # a recompile: dynamo had compiled this frame before (a guard failed)
    seconds: float  # in the backend: forward and backward graphs


class CountingBackend:
    """The torch.compile backend the spec names, with every compiled graph counted when it runs and
    every compilation recorded (which frame, how long). One per engine."""

    def __init__(self, section: Compile):
        from torch._dynamo.backends.registry import lookup_backend

        if section.backend == "inductor":
            mode = None if section.mode == "default" else section.mode
            self.inner = torch._TorchCompileInductorWrapper(mode, None, section.dynamic)
        else:
            self.inner = lookup_backend(section.backend)
        self.__name__ = f"polyshard_{section.backend}"
        self.compiles: list[Compiled] = []
        self.runs = 0  # compiled graphs run, all modules together

    def __call__(self, gm, example_inputs):
        from torch._guards import CompileContext

        start = time.perf_counter()
        compiled = self.inner(gm, example_inputs)
        compile_id = CompileContext.current_compile_id()
        again = compile_id is not None and (compile_id.frame_compile_id or 0) > 0
        self.compiles.append(Compiled(_frame_name(), again, time.perf_counter() - start))

        def run(*args):
            self.runs += 1
            return compiled(*args)

        # the boxed calling convention travels with the function; nothing else may (dynamo would
        # follow __wrapped__ / _torchdynamo_orig_callable back to the uncounted graph)
        if getattr(compiled, "_boxed_call", False):
            run._boxed_call = True
        return run

    def reset(self):
        if hasattr(self.inner, "reset"):
            self.inner.reset()


def _frame_name() -> str:
    """`function (file:line)` of the frame dynamo is compiling, for warnings that name the code: the
    `code` argument of dynamo's `_compile`, found up the stack (no public API hands it over)."""
    from torch._guards import CompileContext

    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_locals.get("code") if frame.f_code.co_name == "_compile" else None
        if isinstance(code, types.CodeType):
            return (f"{code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:"
                    f"{code.co_firstlineno}), compile {CompileContext.current_compile_id()}")
        frame = frame.f_back
    return f"compile {CompileContext.current_compile_id()}"


class _Probe:
    """Wraps one compiled module's call during the first steps: did any compiled graph run inside?"""

    def __init__(self, call, tally: Counter, backend: CountingBackend):
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

    def __init__(self, units: list[tuple[str, nn.Module]], backend: CountingBackend,
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


def apply_compile(model: nn.Module, units: list[tuple[str, nn.Module]], section: Compile,
                  policy: str, loud: bool, compile_model: Callable | None = None) -> CompileWatch | None:
    """compile.enabled: compile each unit in place (scope blocks; whatever sits at the unit's place,
    so an activation-checkpoint wrapper is compiled with its block) or the whole model (scope model;
    `compile_model(backend, kwargs)` where the backend has its own call), and return the watch that
    checks they run compiled. Backends call it where their order needs it; XLA never does (refused).
    `policy`: the spec's wrap.policy, named when it selects no unit."""
    if not section.enabled:
        return None
    # The KV cache only serves generation; with it on, each Hugging Face decoder layer reads its
    # own layer_idx, dynamo specialises every layer on it, and past 8 layers (recompile_limit)
    # the rest run eagerly (docs/compile.md). Activation checkpointing turns it off too.
    if section.scope == "blocks" and not units:
        from parallel.spec.io import SpecError

        raise SpecError([("compile.scope", f"'blocks' compiles the shard units, and wrap.policy "
                          f"{policy!r} selects none in this model; use scope: model, or a wrap "
                          "policy that selects its repeated blocks")])
    disable_kv_cache(model)
    backend = CountingBackend(section)
    targets = at_unit_places(model, units) if section.scope == "blocks" else [("<model>", model)]
    if section.scope == "model" and compile_model is not None:
        compile_model(backend, section.torch_kwargs())
    else:
        for _, module in targets:
            module.compile(backend=backend, **section.torch_kwargs())
    return CompileWatch(targets, backend, section, loud=loud)
