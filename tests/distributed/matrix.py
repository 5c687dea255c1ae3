"""The cross-backend case table, built from the registry: every variant of every backend (its
descriptor's `variants`; the backend itself where it has none), as the spec overrides that run it on
this host at the global batch of `world` ranks (registry.local_run: XLA's CPU client is one process)
and how to launch it. A backend or variant added to the registry is in every test that takes its
cases from here; tests/unit/test_registry_matrix.py checks that nothing is left out.

Tiers: `make test-full` (POLYSHARD_TIER=full) runs every variant in every test that takes its cases
from here. `make test` runs each backend's default variant (what `backend: X` alone gives: FSDP2,
ZeRO-3, XLA v1) in the tests of one concern on every backend (faults, async saves, tracking, the
Hugging Face job, the hot path, the model zoo), and every variant where the variants are the point
(each backend's parity test, the checkpoint transfer cycle: `every=True`), so every variant still
trains, saves and moves in make test and each concern runs on every backend; the product of the two
is make test-full's (the 25-minute budget, tests/conftest.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from parallel import registry
from parallel.spec.io import SpecError, load_spec
from parallel.tools.cells import merged


@dataclass(frozen=True)
class Case:
    name: str  # the variant's name (fsdp2, zero3, xla1, ...): what `--backends` accepts too
    backend: str
    spec: dict  # overrides that run it here (backend, variant, topology, micro_batch_size)
    nproc: int  # processes to launch
    env: dict = field(default_factory=dict)  # the launch's environment: the descriptor's, and
    #                                          the local run's device count (XLA's CPU client)
    flat: bool = False  # the optimizer steps flat tensors (descriptor.flat_optimizer)

    @property
    def launch(self) -> tuple:
        """Cases with the same launch can share one process group."""
        return self.nproc, tuple(sorted(self.env.items()))


FULL = os.environ.get("POLYSHARD_TIER") == "full"  # make test-full


def is_default(backend: str, overrides: dict) -> bool:
    """The variant is what `backend: X` alone runs (the spec's defaults)."""
    return load_spec(merged({"backend": backend}, overrides)) == load_spec({"backend": backend})


def cases(world: int = 2, micro_batch_size: int = 2, skip: tuple[str, ...] = (),
          every: bool | None = None) -> list[Case]:
    """The registry's variants as cases: every one (`every`, or make test-full), else each
    backend's default variant."""
    every = FULL if every is None else every
    out = []
    for d in registry.descriptors():
        for name, overrides in (d.variants or {d.name: {}}).items():
            if name in skip or not (every or not d.variants or is_default(d.name, overrides)):
                continue
            asked = merged({"backend": d.name, "micro_batch_size": micro_batch_size}, overrides)
            # one process driving `world` devices where the backend says its devices per process
            # are known only at run time (SPMD: PJRT's CPU client gets that many virtual devices)
            spmd = d.launch.process_devices(load_spec(asked)) is None
            asked["topology"] = {"procs_per_node": 1 if spmd else world}
            spec = load_spec(asked)
            data, env = registry.local_run(spec)
            env = {**env, "CPU_NUM_DEVICES": str(world)} if spmd else env
            here = {k: data[k] for k in ("backend", "micro_batch_size", "topology", *overrides)
                    if k in data}
            nproc = load_spec(here).world_size
            out.append(Case(name, d.name, here, nproc, env, d.flat_optimizer(spec)))
    return out


def accepting(spec_of, world: int, micro_batch_size: int = 2) -> list[Case]:
    """Every variant whose spec with a dimension (`spec_of(case)`: tp, cp, pp) validates; the
    backends that refuse it are unit-tested."""
    out = []
    for c in cases(world=world, micro_batch_size=micro_batch_size, every=True):
        try:
            load_spec(spec_of(c))
        except SpecError:
            continue
        out.append(c)
    return out


def by_launch(chosen: list[Case]) -> list[list[Case]]:
    """Cases grouped by how they launch, in registry order: one process group per group."""
    groups: dict[tuple, list[Case]] = {}
    for c in chosen:
        groups.setdefault(c.launch, []).append(c)
    return list(groups.values())


def quick(variants: list[Case]) -> list[Case]:
    """make test's share of the variants that have a dimension (tp, cp): per backend its default
    variant where that one has it, else its first that has; make test-full runs them all."""
    defaults = {c.name for c in cases(every=False)}
    out: dict[str, Case] = {}
    for c in variants:
        if c.backend not in out or (c.name in defaults and out[c.backend].name not in defaults):
            out[c.backend] = c
    return [c for c in variants if c in out.values()]
