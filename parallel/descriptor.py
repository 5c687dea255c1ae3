"""What the rest of polyshard knows about a backend: one `BackendDescriptor`, exported by each
`backends/<name>/descriptor.py` and listed by `parallel.registry`, the only lookup.

A descriptor is importable without the backend's own dependency (deepspeed, torch_xla): everything it
holds directly is plain data or a light function; what needs the dependency (the engine, native
checkpoint readers) is a "module:attribute" reference the registry imports on first use. Capabilities
that only some backends have are optional fields (None / empty), never methods that raise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Unsupported:
    """A value a backend cannot honour: why, and what to write instead."""

    reason: str
    nearest: str


@dataclass(frozen=True)
class Capabilities:
    # spec field (dotted: "checkpoint.async_save") -> {value: Unsupported}; a value absent from the
    # map is supported. The spec checks every field named here (a name that is no spec field fails
    # tests/unit/test_registry_matrix.py).
    unsupported: dict[str, dict[Any, Unsupported]] = field(default_factory=dict)
    exports: dict[str, Unsupported] = field(default_factory=dict)  # `polyshard export --to` formats

    def check(self, field_name: str, value) -> Unsupported | None:
        return self.unsupported.get(field_name, {}).get(value)


class ModelStates(Protocol):
    def __call__(self, spec, shapes: list[tuple[int, ...]], n: int, low: int,
                 opt: int) -> tuple[float, float, float]:
        """(params, grads, optimizer) bytes per rank on the device: `n` the shard group size,
        `low` the compute dtype's bytes, `opt` the optimizer's bytes per element."""


class CommVolume(Protocol):
    def __call__(self, spec, psi: float, output_share: float = 0.0) -> float:
        """Collective volume per step in units of Psi elements (`psi`: the parameter count, 0
        when unknown; `output_share`: the fraction of Psi in the final norm and output layer)."""


@dataclass(frozen=True)
class PlanModel:
    """What `polyshard plan` needs: bytes of model states per rank, and collective volume."""

    model_states: ModelStates
    comm: CommVolume


@dataclass(frozen=True)
class BackendDescriptor:
    name: str  # the value of the spec's `backend` field
    summary: str  # one line, for help texts and docs
    capabilities: Capabilities
    # The spec -> the backend's own arguments, as plain data (`polyshard explain`). It is also the
    # backend's validation rule: a SpecError raised here fails spec validation everywhere.
    translate: Callable[[Any], dict]
    engine: str  # "module:callable" taking the Spec, returning an Engine
    extra: str = ""  # the pip extra that installs its dependency ("" for none)
    packages: tuple[str, ...] = ()  # distributions whose versions a checkpoint records
    # Environment every process starts with under `polyshard launch` (a value the user set wins).
    env: Callable[[], dict[str, str]] = dict
    # Spec -> (spec dict, extra env) that runs the same job on this one host when its runtime lays
    # processes out differently (XLA's single-process CPU client); None: as written.
    local_run: Callable | None = None
    accelerator: str = "nvidia.com/gpu"  # what a cluster job requests (Slurm / Kubernetes)
    tensor_parallel: bool = False  # reads topology.tp > 1 (none does yet)
    # Devices one process feeds (SPMD drives all of a host's): None when known only at run time.
    process_devices: Callable[[Any], int | None] = lambda spec: 1
    # Spec -> (benchmarks/ script running the same job without polyshard, its flags), or None where
    # the backend has no hand-written loop for that spec (`polyshard bench --vs-native`).
    native: Callable[[Any], tuple[str, list[str]] | None] = lambda spec: None
    # Short names for common configurations of this backend (name -> spec overrides), which
    # `polyshard bench/parity --backends` accept beside backend names: fsdp1, zero2, xla1, ...
    variants: dict[str, dict] = field(default_factory=dict)
    # Spec -> does the optimizer step flat tensors holding many parameters? Then a parameter a step
    # did not use (an expert no rank routed to) is still updated (docs/moe.md); the engine says so.
    flat_optimizer: Callable[[Any], bool] = lambda spec: False
    plan: PlanModel | None = None
    comm_counted: bool = True  # False: collectives are compiled into a graph, c10d never sees them
    exports: dict[str, Callable] = field(default_factory=dict)  # format -> this backend's spec -> data
    formats: dict[str, Callable] = field(default_factory=dict)  # format -> any spec -> data
    # accelerate config: (distributed_type, whole config) -> how specifically this backend reads it
    # (0: not at all; the highest claim wins), the function that maps its section: (Import, config,
    # the yaml's directory) -> None, and top-level keys it reads beyond accelerate's own
    accelerate_claims: Callable[[str, dict], int] | None = None
    accelerate_section: Callable | None = None
    accelerate_keys: frozenset[str] = frozenset()
    # file kind -> (path, lossy, given) -> (spec dict, report): `polyshard import KIND FILE`
    config_importers: dict[str, Callable] = field(default_factory=dict)
    checkpoint_readers: dict[str, str] = field(default_factory=dict)  # kind -> "module:reader"
    checkpoint_writers: dict[str, str] = field(default_factory=dict)  # kind -> "module:writer"
