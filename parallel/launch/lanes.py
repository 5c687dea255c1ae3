"""Which Python runs a backend's ranks: this one, or its lane's.

torch_xla 2.9.0 is the last torch_xla and needs exactly torch 2.9.0, while the other backends run
on the newest torch (docs/lanes.md). So the XLA backend may live in a virtual environment of its own
(`make` builds `.venv-xla` beside `.venv`). A launch whose backend's packages (its descriptor's
`packages`) do not import here, and whose lane's interpreter is named by `POLYSHARD_PYTHON_<EXTRA>`
(`POLYSHARD_PYTHON_XLA=.venv-xla/bin/python`), starts its ranks with that interpreter: the same
polyshard, the same spec, the other torch. Everything else starts with this one, and a backend with
neither is refused by the backend itself, naming its extra.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def variable(extra: str) -> str:
    """The environment variable naming the interpreter of a backend's lane."""
    return f"POLYSHARD_PYTHON_{extra.upper()}"


def _installed(descriptor) -> bool:
    return all(importlib.util.find_spec(p) is not None for p in descriptor.packages)


def interpreter(backend: str) -> str:
    """The Python executable to start `backend`'s ranks with."""
    from parallel.registry import get

    descriptor = get(backend)
    if _installed(descriptor):
        return sys.executable
    lane = os.environ.get(variable(descriptor.extra))
    if not lane:
        return sys.executable
    path = Path(lane)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise ValueError(f"{variable(descriptor.extra)}={lane}: not an executable file; name the "
                         f"python of the environment holding {', '.join(descriptor.packages)} "
                         f"(make builds .venv-{descriptor.extra}/bin/python)")
    return str(path.absolute())


def available(backend: str) -> bool:
    """Whether `backend` can run from here: its packages import, or its lane is named."""
    from parallel.registry import get

    descriptor = get(backend)
    return _installed(descriptor) or bool(os.environ.get(variable(descriptor.extra)))


def lane_of(package: str) -> str | None:
    """The Python of the lane holding `package` where it does not import here (torch_xla, in
    .venv-xla), None where it imports here or no backend's named lane holds it."""
    from parallel.registry import descriptors

    if importlib.util.find_spec(package) is not None:
        return None
    return next((interpreter(d.name) for d in descriptors()
                 if package in d.packages and os.environ.get(variable(d.extra))), None)
