"""The cells `polyshard bench` and `polyshard parity` run: one spec per backend or variant name
(fsdp, fsdp1, zero2, xla1, ...: parallel/registry.py `cell`), the user's spec with that name's
overrides merged in."""

from __future__ import annotations

from parallel.registry import cell


def merged(base: dict, changes: dict) -> dict:
    """`changes` over `base`, sections merged key by key (a variant's `fsdp: {version: 1}` keeps the
    spec's other fsdp fields)."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(
            out.get(key), dict) else value
    return out


def cell_data(spec, name: str, **changes) -> dict:
    """The spec data of cell `name`: its backend and overrides, then `changes` (shard, topology)."""
    backend, overrides = cell(name)
    data = merged(spec.model_dump(mode="json", exclude_unset=True), {"backend": backend})
    data.pop("tracking", None)  # a measurement cell logs nothing of its own (bench, parity)
    return merged(merged(data, overrides), changes)


def fixed_by(name: str) -> set[str]:
    """The spec fields cell `name` sets itself (zero2 sets shard: a --shard axis does not apply)."""
    return set(cell(name)[1])
