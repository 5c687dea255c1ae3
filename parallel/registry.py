"""The one place that maps `backend` to code. Backends are imported only when asked for, so `import
parallel` and `polyshard validate` work without deepspeed or torch_xla installed."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import get_args

from parallel.spec.capabilities import CAPABILITIES
from parallel.launch.envinfo import detect_pjrt_device
from parallel.spec.model import Backend, Spec


@dataclass(frozen=True)
class BackendEntry:
    module: str  # import path of the adapter
    engine: str  # callable in it: Spec -> Engine
    extra: str  # the pip extra that installs its dependency
    # Environment every process of this backend starts with (set by `polyshard launch`; a value
    # the user exported wins).
    env: Callable[[], dict[str, str]] = field(default=dict)
    # Name of a function in the adapter, Spec -> (spec dict, extra env), that runs the same job on
    # this one host when its runtime lays processes out differently (XLA's CPU client); None: as is.
    local: str | None = None
    # The hand-written loop in benchmarks/ that runs the same job without polyshard (bench
    # --vs-native compares step times against it).
    native: str = ""
    # The accelerator a cluster job must request for it (Slurm --gpus-per-node, k8s limits).
    accelerator: str = "nvidia.com/gpu"


# accelerate and transformers import torch_xla whenever it is installed, and accelerate then picks XLA
# even under torchrun unless USE_TORCH_XLA=0: the non-XLA backends pin it off.
BACKENDS: dict[str, BackendEntry] = {
    "fsdp": BackendEntry("backends.fsdp", "FSDPEngine", "", lambda: {"USE_TORCH_XLA": "0"},
                         native="native_fsdp2.py"),
    "deepspeed": BackendEntry("backends.deepspeed", "DeepSpeedEngine", "deepspeed",
                              lambda: {"USE_TORCH_XLA": "0"}, native="native_deepspeed.py"),
    "xla_fsdp": BackendEntry("backends.xla", "XlaEngine", "xla",
                             lambda: {"PJRT_DEVICE": detect_pjrt_device(), "USE_TORCH_XLA": "1"},
                             local="local_run", native="native_xla.py", accelerator=""),
}
assert set(BACKENDS) == set(get_args(Backend)) == set(CAPABILITIES), "registry out of sync"


def load_backend(name: str):
    entry = BACKENDS[name]
    try:
        return importlib.import_module(entry.module)
    except ImportError as err:
        hint = f"pip install 'polyshard[{entry.extra}]'" if entry.extra else "reinstall polyshard"
        raise RuntimeError(f"backend: {name!r} needs {err.name or entry.module}, which is not "
                           f"importable ({err}); {hint}") from err


def create_engine(spec: Spec):
    """The Engine for `spec.backend`."""
    entry = BACKENDS[spec.backend]
    return getattr(load_backend(spec.backend), entry.engine)(spec)


def explain(spec: Spec) -> dict:
    """What the spec becomes on its backend, as plain data (the backend's `translate`)."""
    return {"backend": spec.backend, **load_backend(spec.backend).translate(spec)}


def local_run(spec: Spec) -> tuple[dict, dict[str, str]]:
    """The spec (as data) and environment that run `spec`'s job on this host, same global batch."""
    entry = BACKENDS[spec.backend]
    data = spec.model_dump(mode="json", exclude_unset=True)
    if entry.local is None:
        return data, entry.env()
    adapted, env = getattr(load_backend(spec.backend), entry.local)(spec)
    return adapted, {**entry.env(), **env}
