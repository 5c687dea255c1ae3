"""`xla.fsdp_version` picks the engine: v1.py (one process per device) or spmd.py (one per host)."""

from __future__ import annotations

from parallel.engine.core.engine import Engine
from parallel.spec.model import Spec


def make_engine(spec: Spec, **context) -> Engine:
    if spec.xla.fsdp_version == 2:
        from backends.xla.spmd import XlaSpmdEngine

        return XlaSpmdEngine(spec, **context)
    from backends.xla.v1 import XlaFsdpEngine

    return XlaFsdpEngine(spec, **context)
