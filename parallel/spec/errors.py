"""Errors of specs, as every layer raises them (a kit: it imports nothing of polyshard's).

Every error becomes a `(field path, message)` pair whose message names the value, the rule and a fix, so
the CLI can print `path: message` lines and exit 2 without a traceback. `rule_error` carries such pairs
out of a pydantic validator; `explain_validation_error` turns pydantic's own errors into them;
`merge_native` is the rule every backend's `native:` passthrough follows.
"""

from __future__ import annotations

import difflib
import re

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from parallel.kits.problems import SpecError  # the one error class, raised below the spec too

__all__ = ["SpecError", "explain_validation_error", "merge_native", "rule_error", "validate_as"]


def rule_error(*problems: tuple[str, str]) -> PydanticCustomError:
    """One validation error carrying `(field path, message)` pairs; `explain_validation_error`
    expands them."""
    text = "; ".join(f"{p}: {m}" for p, m in problems)
    return PydanticCustomError("spec_rule", "{text}", {"text": text, "problems": list(problems)})


def validate_as(cls: type[BaseModel], data: dict):
    """`data` validated by `cls` (a spec class: the registry's, or an existing spec's `type(spec)`),
    or SpecError naming every problem."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise SpecError(explain_validation_error(err, cls)) from None


def explain_validation_error(err: ValidationError, model: type[BaseModel]) -> list[tuple[str, str]]:
    """pydantic's errors of validating `model` as (field path, message) pairs."""
    problems: list[tuple[str, str]] = []
    errors = err.errors()
    if len(errors) > MAX_SHOWN:  # a file with 300k bad entries gets a page, not 30 MB
        problems.append(("<spec>", f"{len(errors):,} problems; the first {MAX_SHOWN} follow"))
    for e in errors[:MAX_SHOWN]:
        ctx = e.get("ctx") or {}
        if e["type"] == "spec_rule":
            problems.extend(tuple(p) for p in ctx["problems"])
            continue
        path = ".".join(_short(x) for x in e["loc"]) or "<spec>"
        problems.append((path, _message(e, model)))
    return problems


def _message(e: dict, root: type[BaseModel]) -> str:
    value = e.get("input")
    kind = e["type"]
    if kind == "extra_forbidden":
        known = list(_model_at(root, e["loc"][:-1]).model_fields)
        hint = _closest(str(e["loc"][-1]), known)
        fix = f"did you mean {hint!r}?" if hint else f"known fields: {', '.join(known)}"
        return f"unknown field (value {_shown(value)}); {fix}"
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'|(\d+)", e["ctx"]["expected"])
        choices = [a or b for a, b in choices]
        hint = _closest(str(value), choices)
        fix = f"did you mean {hint!r}?" if hint else f"choose one of {', '.join(choices)}"
        return f"{_shown(value)} is not allowed; {fix}"
    return f"{e['msg']} (got {_shown(value)})"


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel]:
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


MAX_SHOWN = 20


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 100 else f"{text[:97]}..."


def _short(part) -> str:
    """A path component as printed: a 300k-character key from a file is cut, not echoed whole."""
    text = str(part)
    return text if len(text) <= 60 else f"{text[:57]}..."
