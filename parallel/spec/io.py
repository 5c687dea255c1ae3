"""Reading, overriding and dumping specs. A dispatcher: a spec is validated by the class the registry
assembles from the spec's own fields and every backend's section (parallel/registry.py), so nothing a
backend imports may import this module (errors.py holds what they share)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from parallel.spec.errors import SpecError, validate_as
from parallel.spec.model import Spec


def load_spec(source: str | Path | dict | Spec | None = None, overrides: list[str] = (),
              world: int | None = None) -> Spec:
    """Build a Spec from a YAML/JSON file, a dict or a Spec, then apply `key.path=value` overrides;
    `world`: laid out over that many ranks before it is validated (`plan` / `dryrun --world`: a
    layout such as cp 4 x tp 8 is checked against the world asked about, not the file's)."""
    if isinstance(source, Spec):
        data = source.model_dump(exclude_unset=True)
    elif isinstance(source, dict):
        data = json.loads(json.dumps(source))  # a deep copy that also rejects non-JSON values early
    elif source is None:
        data = {}
    else:
        data = read_document(Path(source))
    for item in overrides:
        apply_override(data, item)
    for notice in drop_irrelevant(data, overrides):
        print(f"polyshard: {notice}", file=sys.stderr, flush=True)
    if world is not None:
        data = over_world(data, world)
    return validate(data)


# A section read only under its gate's values: (the gate's path, the values under which the section
# means nothing, what reads it)
GATES = {"pipeline": ("topology.pp", lambda v: v in (None, 1), "topology.pp > 1"),
         "float8": ("precision", lambda v: v != "fp8", "precision: fp8")}


def drop_irrelevant(data: dict, overrides: list[str]) -> list[str]:
    """A section that an override's new value makes irrelevant is dropped, saying so: moving a pp 2
    job to pp 1, or an fp8 job to bf16, is the one --set that says it (a file that holds both
    is still refused: it was written that way). Returns the notices."""
    paths = [item.split("=", 1)[0].strip() for item in overrides]
    notices = []
    for section, (gate, idle, reader) in GATES.items():
        if gate not in paths or section not in data or any(
                p == section or p.startswith(section + ".") for p in paths):
            continue
        value = data
        for part in gate.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if idle(value):
            data.pop(section)
            notices.append(f"{section}: dropped, since --set {gate}={value} leaves it unread (it "
                           f"is read with {reader})")
    return notices


def over_world(data: dict, world: int) -> dict:
    """The spec's data over `world` ranks: procs_per_node kept where it divides (one host's GPUs),
    else one host of `world`; the global batch dropped (the micro-batch's multiple at this world)."""
    topology = data.get("topology") if isinstance(data.get("topology"), dict) else {}
    per_node = topology.get("procs_per_node", 1)
    per_node = per_node if isinstance(per_node, int) and per_node > 0 and world % per_node == 0 \
        else world
    data = {**data, "topology": {**topology, "nodes": world // per_node, "procs_per_node": per_node}}
    data.pop("global_batch_size", None)
    return data


def validate(data: dict) -> Spec:
    """`data` as a Spec of the registered backends (the class parallel/registry.py assembles), or
    SpecError naming every problem."""
    from parallel.registry import spec_class

    return validate_as(spec_class(), data)


def read_document(path: Path) -> dict:
    """A spec file: YAML (a superset of JSON: one parser for both), bounded and without aliases
    (parallel/files.py)."""
    from parallel.files import FileError, load_yaml

    if not path.exists():
        raise SpecError([(str(path), "no such file; pass the path of a YAML or JSON spec")])
    try:
        data = load_yaml(path, "a spec")
    except FileError as err:
        file, _, problem = str(err).partition(": ")
        raise SpecError([(file, problem)]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SpecError([(str(path), f"must hold a mapping of fields, not {type(data).__name__}")])
    return data


def apply_override(data: dict, item: str) -> None:
    """`a.b=value` sets data["a"]["b"]; the value is parsed as YAML (numbers, booleans, lists)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise SpecError([(item, "an override must look like `field.path=value`, e.g. "
                                "`backend=deepspeed` or `fsdp.version=1`")])
    *parents, leaf = key.strip().split(".")
    node = data
    for name in parents:
        child = node.setdefault(name, {})
        if not isinstance(child, dict):
            raise SpecError([(key, f"cannot set a sub-field: {name!r} holds {child!r}")])
        node = child
    try:
        node[leaf] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:  # not YAML (found by fuzzing: `@`, `{`): the text itself, as a string
        node[leaf] = raw


def dump_spec(spec: Spec, full: bool = False) -> str:
    """YAML of the spec: what the user wrote (default), or every field with its value (full=True)."""
    data = spec.model_dump(mode="json", exclude_unset=not full)
    return yaml.safe_dump(data, sort_keys=False)


def json_schema() -> dict:
    """The JSON Schema of the spec (editor completion), its `backend` listing the registered ones."""
    from parallel.registry import names, spec_class

    schema = spec_class().model_json_schema()
    schema["properties"]["backend"]["enum"] = names()
    return schema
