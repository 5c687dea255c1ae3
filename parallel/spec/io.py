"""Reading, overriding, dumping and explaining errors of specs.

Every error becomes a `(field path, message)` pair whose message names the value, the rule and a fix, so
the CLI can print `path: message` lines and exit 2 without a traceback.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from parallel.spec.model import Spec


class SpecError(ValueError):
    """A spec that cannot be used; `problems` holds `(path, message)` pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("\n".join(f"{p}: {m}" for p, m in problems))


def load_spec(source: str | Path | dict | Spec | None = None, overrides: list[str] = ()) -> Spec:
    """Build a Spec from a YAML/JSON file, a dict or a Spec, then apply `key.path=value` overrides."""
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
    try:
        return Spec.model_validate(data)
    except ValidationError as err:
        raise SpecError(explain_validation_error(err)) from None


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
    return Spec.model_json_schema()


def explain_validation_error(err: ValidationError) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    for e in err.errors():
        ctx = e.get("ctx") or {}
        if e["type"] == "spec_rule":
            problems.extend(tuple(p) for p in ctx["problems"])
            continue
        path = ".".join(str(x) for x in e["loc"]) or "<spec>"
        problems.append((path, _message(e)))
    return problems


def _message(e: dict) -> str:
    value = e.get("input")
    kind = e["type"]
    if kind == "extra_forbidden":
        known = list(_model_at(e["loc"][:-1]).model_fields)
        hint = _closest(str(e["loc"][-1]), known)
        fix = f"did you mean {hint!r}?" if hint else f"known fields: {', '.join(known)}"
        return f"unknown field (value {value!r}); {fix}"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'|(\d+)", e["ctx"]["expected"])
        choices = [a or b for a, b in choices]
        hint = _closest(str(value), choices)
        fix = f"did you mean {hint!r}?" if hint else f"choose one of {', '.join(choices)}"
        return f"{value!r} is not allowed; {fix}"
    return f"{e['msg']} (got {value!r})"


def _model_at(loc: tuple) -> type[BaseModel]:
    model: type[BaseModel] = Spec
    for name in loc:
        annotation = model.model_fields[name].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
    return model


def _closest(word: str, options: list[str]) -> str | None:
    found = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return found[0] if found else None



def merge_native(computed: dict, origins: dict[str, str], native: dict, where: str) -> dict:
    """Merge a backend's `native:` passthrough last. A native key that the spec already decided, with a
    different value, is an error naming both; an equal value or a new key is accepted. "auto" means
    what it means in every `native:` section: the spec's value, an error where the spec has none."""
    problems = []
    for key, value in native.items():
        if value == "auto" and key not in computed:
            problems.append((f"{where}.{key}", "is \"auto\" but the spec has no value for it; give "
                             "a value or remove the key"))
        elif key in computed and computed[key] != value and value != "auto":
            origin = origins.get(key, "the spec")
            problems.append((f"{where}.{key}", f"{value!r} contradicts {origin}, which "
                             f"sets {key}={computed[key]!r}; change {origin} instead or drop the key"))
    if problems:
        raise SpecError(problems)
    return {**computed, **{k: v for k, v in native.items() if v != "auto"}}
