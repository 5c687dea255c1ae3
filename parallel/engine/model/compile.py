"""torch.compile, applied the same way on every backend that runs it.

`apply_compile` compiles each module in place (`nn.Module.compile`), so it keeps its place, name and
parameters in the tree: FSDP and DeepSpeed shard or hook it as before, and checkpoints see the same
names. Every compile goes through one backend object (`CountingBackend`) that wraps each graph it
produces so that running it adds one to that backend's counter; the watch that reads the counter
(did it run compiled?) is parallel/engine/watch/compile.py.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from parallel.engine.model.wrap import at_unit_places, disable_kv_cache
from parallel.engine.watch.compile import CompileWatch
from parallel.spec.compiling import Compile


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


def allow_checkpointed_side_effects() -> None:
    """Activation checkpointing under compile: transformers 5 wraps its attention (and norms) in the
    `kernels` package's hub-kernel forward, which sets and resets a module-level context variable in
    every call. Dynamo refuses a mutation inside the checkpoint's higher-order op unless told the
    recomputation may skip it ("HOP: Unsafe side effect", measured with transformers 5.25 and
    kernels 0.19.1: every checkpointed block ran eagerly). The variable is reset before the forward
    returns, so skipping it in the recomputation changes nothing; polyshard sets dynamo's flag
    (process-wide, docs/compile.md)."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


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
        from parallel.spec.errors import SpecError

        raise SpecError([("compile.scope", f"'blocks' compiles the shard units, and wrap.policy "
                          f"{policy!r} selects none in this model; use scope: model, or a wrap "
                          "policy that selects its repeated blocks")])
    disable_kv_cache(model)
    if any(hasattr(m, "_checkpoint_wrapped_module") for m in model.modules()):
        allow_checkpointed_side_effects()
    backend = CountingBackend(section)
    targets = at_unit_places(model, units) if section.scope == "blocks" else [("<model>", model)]
    if section.scope == "model" and compile_model is not None:
        compile_model(backend, section.torch_kwargs())
    else:
        for _, module in targets:
            module.compile(backend=backend, **section.torch_kwargs())
    return CompileWatch(targets, backend, section, loud=loud)
