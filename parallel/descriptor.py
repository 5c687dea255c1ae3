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
class Options:
    """The backend's own section of the spec: `spec.<section>`, a pydantic model of its package
    (backends/<name>/options.py) that the registry adds to the spec. Knobs that exist on this
    backend only; everything the backends share is a neutral field."""

    section: str  # the spec field: fsdp, deepspeed, xla
    model: type  # a parallel.spec.sections.Section subclass, every field documented
    description: str  # one line, the section's description in the schema and the README


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
    def __call__(self, spec, psi: float, output_share: float = 0.0, root_share: float = 0.0
                 ) -> float:
        """Collective volume per step in units of Psi elements (`psi`: the parameter count, 0
        when unknown; `output_share`: the fraction of Psi in the final norm and output layer;
        `root_share`: in what no wrap unit holds, the root's: embeddings, final norm, head)."""


class Transient(Protocol):
    def __call__(self, spec, psi: float, unit: float, low: int, hidden: int | None = None
                 ) -> tuple[float, float]:
        """(gathered parameter bytes, communication buffer bytes) a rank holds at its peak beyond
        its model states: `psi` parameters, `unit` the largest shard unit's, `low` the compute
        dtype's bytes, `hidden` the model's hidden size where known (what buffers sized to the
        model are sized from)."""


@dataclass(frozen=True)
class PlanModel:
    """What `polyshard plan` needs: bytes of model states per rank, collective volume, and what is
    held only transiently (gathered units, buckets); None: like FULL_SHARD (two units gathered,
    one unit's gradient in flight)."""

    model_states: ModelStates
    comm: CommVolume
    transient: Transient | None = None


class Translate(Protocol):
    def __call__(self, spec) -> dict:
        """The backend's own arguments for `spec`, as plain data (`polyshard explain`); a
        SpecError raised here is a validation rule of the backend."""


class SpecFacts(Protocol):  # process_devices, flat_optimizer
    def __call__(self, spec) -> Any: ...


class LocalRun(Protocol):
    def __call__(self, spec, devices: int | None = None) -> tuple[dict, dict[str, str]]:
        """(spec dict, extra env) that run the same job (same global batch) on this one host;
        `devices`: how many devices one SPMD process drives here (default: the spec's world)."""


class NativeLoop(Protocol):
    def __call__(self, spec) -> tuple[str, list[str]] | None:
        """(benchmarks/ script running the same job without polyshard, its flags), or None."""


class Export(Protocol):
    def __call__(self, spec) -> dict:
        """The spec as another tool's config (accelerate, hf-trainer, deepspeed)."""


class AccelerateClaims(Protocol):
    def __call__(self, distributed_type: str, config: dict) -> int:
        """How specifically this backend reads an accelerate config (0: not at all; the highest
        claim wins)."""


class AccelerateSection(Protocol):
    def __call__(self, imported, config: dict, directory) -> None:
        """Maps the backend's section of an accelerate config into `imported` (an Import)."""


class ConfigImporter(Protocol):
    def __call__(self, path, lossy: bool, given: dict, validate: Callable[[dict], Any]
                 ) -> tuple[dict, Any]:
        """A backend's own config file -> (spec dict, report): `polyshard import KIND FILE`;
        `validate`: the spec validation the result must pass (the dispatcher's load_spec)."""


def _one_device(spec) -> int:
    return 1


def _no_native(spec) -> None:
    return None


def _not_flat(spec) -> bool:
    return False


@dataclass(frozen=True)
class Launch:
    """How this backend's processes start."""

    # Environment every process starts with under `polyshard launch` (a value the user set wins).
    env: Callable[[], dict[str, str]] = dict
    # Where the runtime lays processes out differently on this host (XLA's single-process CPU
    # client); None: as written.
    local_run: LocalRun | None = None
    accelerator: str = "nvidia.com/gpu"  # what a cluster job requests (Slurm / Kubernetes)
    # Devices one process feeds (SPMD drives all of a host's): None when known only at run time.
    process_devices: SpecFacts = _one_device
    # Why `notebook_launch` cannot start this spec's processes itself (None: it can): a runtime
    # whose processes need their own start (torch_xla's multi-process PJRT set-up).
    in_process_refusal: Callable[[object], str | None] = lambda spec: None


@dataclass(frozen=True)
class Interop:
    """Other tools' files in and out."""

    exports: dict[str, Export] = field(default_factory=dict)  # format -> this backend's spec -> data
    formats: dict[str, Export] = field(default_factory=dict)  # format -> any spec -> data
    accelerate_claims: AccelerateClaims | None = None
    accelerate_section: AccelerateSection | None = None
    # top-level keys of an accelerate file this backend reads beyond accelerate's own
    accelerate_keys: frozenset[str] = frozenset()
    config_importers: dict[str, ConfigImporter] = field(default_factory=dict)  # `polyshard import`


@dataclass(frozen=True)
class Checkpoints:
    """Native checkpoint formats, as "module:callable" references imported on first use."""

    # kind -> reader: src dir -> (portable state, steps, world size)
    readers: dict[str, str] = field(default_factory=dict)
    # kind -> writer: (checkpoint path, out dir) -> path written
    writers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Bench:
    """What `polyshard bench` compares against and can count."""

    native: NativeLoop = _no_native  # `polyshard bench --vs-native`
    comm_counted: bool = True  # False: collectives are compiled into a graph, c10d never sees them
    # `polyshard dryrun`: spec overrides under which one rank of a world of N is built from a
    # meta-device model over torch's fake process group (nothing broadcast from rank 0: the fake
    # group moves no data); None: the backend cannot run that way
    dryrun: dict | None = None


@dataclass(frozen=True)
class BackendDescriptor:
    name: str  # the value of the spec's `backend` field
    summary: str  # one line, for help texts and docs
    capabilities: Capabilities
    # The spec -> the backend's own arguments, as plain data (`polyshard explain`). It is also the
    # backend's validation rule: a SpecError raised here fails spec validation everywhere.
    translate: Translate
    engine: str  # "module:callable" taking (Spec, packages=...), returning an Engine
    extra: str = ""  # the pip extra that installs its dependency ("" for none)
    packages: tuple[str, ...] = ()  # distributions whose versions a checkpoint records
    # its own section of the spec (None: it has no knobs of its own)
    options: Options | None = None
    # the dimensions beyond data parallelism it implements (parallel/spec/dims.py MODEL_DIMS: tp,
    # cp, pp, ep): the spec refuses any other above 1, naming it; the backend's translate refuses
    # the modes it cannot split in
    dimensions: frozenset[str] = frozenset()
    # why it lacks a dimension (name -> reason, measured), said in the refusal of that dimension
    lacking: dict[str, str] = field(default_factory=dict)
    # Short names for common configurations of this backend (name -> spec overrides), which
    # `polyshard bench/parity --backends` and every cross-backend test take: fsdp1, zero2, xla1...
    variants: dict[str, dict] = field(default_factory=dict)
    # Spec -> does the optimizer step flat tensors holding many parameters? Then a parameter a step
    # did not use (an expert no rank routed to) is still updated (docs/moe.md); the engine says so.
    flat_optimizer: SpecFacts = _not_flat
    plan: PlanModel | None = None
    launch: Launch = Launch()
    interop: Interop = Interop()
    checkpoints: Checkpoints = Checkpoints()
    bench: Bench = Bench()
