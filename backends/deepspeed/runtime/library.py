"""DeepSpeed imported without what it imports for features polyshard never runs: two hidden costs of
every rank of every DeepSpeed job, measured on this 2-core host (docs/deepspeed.md, items 11-12).

- `import deepspeed` imports its autotuner, which imports mlflow where it is installed
  (`try: import mlflow`, deepspeed/autotuning/autotuner.py), only to report autotuning runs.
  polyshard's `tracking` extra installs mlflow: `import deepspeed` took 6.5-8.0 s, 4.5-4.8 s
  without it. The first import hides mlflow for its length (the autotuner records
  `has_mlflow = False`); mlflow imports as before right after, for an mlflow tracker.
- Every `deepspeed.initialize` with ZeRO checks the optimizer against its supported list, and the
  check imports DeepSpeed's Muon optimizer first (runtime/zero/utils.py,
  is_zero_supported_optimizer), whose three `@torch.compile` decorators import torch's inductor
  while decorating: 5.1 s, for an optimizer the job does not use. Here that module is imported with
  each decorator's compile put off to the function's first call. torch.compile compiles at the
  first call anyway, so a job that does use Muon runs the same compiled functions.

Where deepspeed was imported already (by the user's script, or accelerate), nothing changes.
"""

from __future__ import annotations

import functools
import sys
from types import ModuleType

MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_deepspeed() -> ModuleType:
    """The deepspeed module, imported at most once per process as above."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError meanwhile
    try:
        import deepspeed
    finally:
        if hide and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    if "torch._inductor.compile_fx" not in sys.modules:  # else decorating costs nothing more
        _import_compiling_later(MUON)
    return deepspeed


def _import_compiling_later(name: str) -> None:
    """Module `name` imported with torch.compile, as a decorator, compiling at the first call."""
    import importlib

    import torch

    compile_now = torch.compile

    def compile_later(fn=None, **options):
        if fn is None:  # @torch.compile(mode=...)
            return lambda f: compile_later(f, **options)
        compiled = []

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not compiled:
                compiled.append(compile_now(fn, **options))
            return compiled[0](*args, **kwargs)

        return call

    torch.compile = compile_later
    try:
        importlib.import_module(name)
    except ImportError:  # a DeepSpeed without Muon: its check imports nothing either
        pass
    finally:
        torch.compile = compile_now
