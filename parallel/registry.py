"""The one place that knows which backends exist: a list of descriptors (parallel/descriptor.py), one
per `backends/<name>/` package, and the lookups everything else uses. Descriptors import no backend
dependency, so `import parallel` and `polyshard validate` work without deepspeed or torch_xla; what
needs it (an engine, a native checkpoint reader) is imported here on first use.

Adding a backend: a package `backends/<name>/` with a `descriptor.py`, and its line below.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import sys

from backends.deepspeed.descriptor import DESCRIPTOR as DEEPSPEED
from backends.fsdp.descriptor import DESCRIPTOR as FSDP
from backends.xla.descriptor import DESCRIPTOR as XLA
from parallel.descriptor import BackendDescriptor

_DESCRIPTORS: dict[str, BackendDescriptor] = {d.name: d for d in (FSDP, DEEPSPEED, XLA)}


def register(descriptor: BackendDescriptor) -> None:
    """Add a backend at run time (a plugin, or a test's own backend)."""
    _DESCRIPTORS[descriptor.name] = descriptor


def unregister(name: str) -> None:
    _DESCRIPTORS.pop(name, None)


def spec_class():
    """The Spec specs are validated with: parallel/spec/model.py's fields and rules, each registered
    backend's own section (its descriptor's `options`), and this registry as the lookup of the
    backends' rules. Assembled once per set of sections (a backend registered with a section of
    its own gets a class with it)."""
    return _assemble(tuple(d.options for d in _DESCRIPTORS.values() if d.options is not None))


@functools.cache
def _assemble(options: tuple) -> type:
    from pydantic import Field, create_model

    from parallel.spec.model import Spec

    sections = {o.section: (o.model, Field(o.model(), description=o.description)) for o in options}
    cls = create_model("Spec", __base__=Spec, __module__=__name__, **sections)
    cls.backends = sys.modules[__name__]  # get(name): the descriptors registered at validation
    cls.sections = tuple(sections)
    return cls


def __getattr__(name: str):
    if name == "Spec":  # `parallel.registry.Spec`, where pickle looks an assembled class up
        return spec_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def names() -> list[str]:
    return list(_DESCRIPTORS)


def descriptors() -> list[BackendDescriptor]:
    return list(_DESCRIPTORS.values())


def get(name: str) -> BackendDescriptor:
    if name not in _DESCRIPTORS:
        from parallel.spec.errors import SpecError

        hint = difflib.get_close_matches(name, names(), n=1, cutoff=0.6)
        raise SpecError([("backend", f"{name!r} is no backend" + (f"; did you mean {hint[0]!r}?"
                                                                  if hint else "")
                          + f" (choose one of {', '.join(names())})")])
    return _DESCRIPTORS[name]


def cell(name: str) -> tuple[str, dict]:
    """A backend name or one of a backend's variants (fsdp1, zero2, xla1, ...) -> (backend, spec
    overrides): what `--backends` of bench and parity accept."""
    if name in _DESCRIPTORS:
        return name, {}
    for d in _DESCRIPTORS.values():
        if name in d.variants:
            return d.name, d.variants[name]
    every = names() + [v for d in _DESCRIPTORS.values() for v in d.variants]
    hint = difflib.get_close_matches(name, every, n=1, cutoff=0.6)
    raise ValueError(f"--backends: {name!r} is neither a backend nor a variant"
                     + (f"; did you mean {hint[0]!r}?" if hint else "")
                     + f" (choose from {', '.join(every)})")


def load(descriptor: BackendDescriptor, ref: str):
    """Import "module:attribute" for `descriptor`, naming the pip extra when its dependency is
    missing."""
    module, _, attr = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as err:
        hint = f"pip install 'polyshard[{descriptor.extra}]'" if descriptor.extra else \
            "reinstall polyshard"
        raise RuntimeError(f"backend: {descriptor.name!r} needs {err.name or module}, which is not "
                           f"importable ({err}); {hint}") from err


def create_engine(spec):
    """The Engine for `spec.backend`; its checkpoints record the versions of the backend's
    packages."""
    descriptor = get(spec.backend)
    return load(descriptor, descriptor.engine)(spec, packages=descriptor.packages)


def explain(spec) -> dict:
    """What the spec becomes on its backend, as plain data (the backend's `translate`)."""
    return {"backend": spec.backend, **get(spec.backend).translate(spec)}


def local_run(spec, devices: int | None = None) -> tuple[dict, dict[str, str]]:
    """The spec (as data) and environment that run `spec`'s job on this host, same global batch;
    `devices`: the devices one SPMD process drives (bench cells at a world size)."""
    descriptor = get(spec.backend)
    data = spec.model_dump(mode="json", exclude_unset=True)
    launch = descriptor.launch
    if launch.local_run is None:
        return data, launch.env()
    adapted, env = launch.local_run(spec, devices)
    return adapted, {**launch.env(), **env}


def local_layout(spec) -> tuple[dict, dict[str, str], str | None]:
    """local_run, and one line saying what it changed from the spec as written (None: nothing):
    the fields that differ, the environment it sets, and that the global batch is the same."""
    data, env = local_run(spec)
    written = spec.model_dump(mode="json")
    adapted = type(spec).model_validate(data).model_dump(mode="json")
    changed = [f"{key} {before} -> {adapted_value}" for key, before, adapted_value in
               _differences(written, adapted)]
    ours = {k: v for k, v in env.items() if k not in get(spec.backend).launch.env()}
    if not changed and not ours:
        return data, env, None
    what = ", ".join([*changed, *(f"{k}={v}" for k, v in sorted(ours.items()))])
    return data, env, (f"{spec.backend} on this host runs as {what} (the layout its runtime "
                       "supports here; the global batch is unchanged)")


def _differences(a: dict, b: dict, prefix: str = ""):
    for key in a:
        if isinstance(a[key], dict) and isinstance(b.get(key), dict):
            yield from _differences(a[key], b[key], f"{prefix}{key}.")
        elif a[key] != b.get(key):
            yield f"{prefix}{key}", a[key], b.get(key)


def accelerate_reader(kind: str, cfg: dict):
    """The section reader of the backend that reads an accelerate file of this kind most
    specifically (claims are priorities), or None when none reads it."""
    claims = [(d.interop.accelerate_claims(kind, cfg), d.interop.accelerate_section)
              for d in descriptors() if d.interop.accelerate_claims is not None]
    best = max(claims, key=lambda c: c[0], default=(0, None))
    return best[1] if best[0] > 0 else None


def accelerate_keys() -> set[str]:
    """Top-level accelerate-file keys some backend reads beyond accelerate's own."""
    return {k for d in descriptors() for k in d.interop.accelerate_keys}


def config_importer(kind: str):
    """(path, lossy, given) -> (spec dict, report) for a config file kind a backend reads."""
    for d in descriptors():
        if kind in d.interop.config_importers:
            return d.interop.config_importers[kind]
    raise KeyError(kind)


def config_import_kinds() -> list[str]:
    return [k for d in descriptors() for k in d.interop.config_importers]


def exporter(fmt: str, backend: str):
    """spec -> data in format `fmt`: the backend's own export, else a format any spec converts to."""
    from parallel.spec.errors import SpecError

    descriptor = get(backend)
    if fmt in descriptor.interop.exports:
        return descriptor.interop.exports[fmt]
    for d in descriptors():
        if fmt in d.interop.formats:
            return d.interop.formats[fmt]
    why = descriptor.capabilities.exports.get(fmt)
    raise SpecError([("backend", f"{backend!r} has no {fmt} export" + (
        f": {why.reason}; use {why.nearest}" if why else f"; it exports to "
        f"{', '.join(sorted(descriptor.interop.exports) + sorted(_formats()))}"))])


def export_formats() -> list[str]:
    return sorted({k for d in descriptors() for k in d.interop.exports} | set(_formats()))


def _formats() -> list[str]:
    return [k for d in descriptors() for k in d.interop.formats]


def _checkpoint_io(kind: str, table: str):
    for d in descriptors():
        refs = getattr(d.checkpoints, table)
        if kind in refs:
            return load(d, refs[kind])
    raise KeyError(kind)


def checkpoint_reader(kind: str):
    """src dir -> (portable state, steps, world size): torch DCP's layout, or a backend's native
    checkpoint format, in."""
    if kind == "dcp":
        from parallel.checkpoint.importers import read_dcp

        return read_dcp
    return _checkpoint_io(kind, "readers")


def checkpoint_kinds() -> list[str]:
    """What `polyshard ckpt import` reads: torch DCP, and every backend's native formats."""
    return ["dcp", *(k for d in descriptors() for k in d.checkpoints.readers)]


def checkpoint_writer(kind: str):
    """(checkpoint path, out dir) -> path written: a backend's native checkpoint format out."""
    return _checkpoint_io(kind, "writers")


def checkpoint_writer_kinds() -> list[str]:
    return [k for d in descriptors() for k in d.checkpoints.writers]


def packages() -> list[str]:
    """Distributions of every backend whose versions a checkpoint records."""
    return [p for d in descriptors() for p in d.packages]
