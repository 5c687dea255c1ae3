"""The spec reference (docs/spec.md), generated from the pydantic models of the spec the registry
assembles, every backend's section included (a unit test keeps them in sync).

    python -m parallel.spec.doc docs/spec.md
"""

from __future__ import annotations

import typing
from pathlib import Path

from pydantic import BaseModel


BEGIN, END = "<!-- spec-reference:begin -->", "<!-- spec-reference:end -->"


def _type(annotation) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if args:
        return " \\| ".join(_type(a) for a in args)
    return getattr(annotation, "__name__", str(annotation)).replace("NoneType", "null")


def rows(model: type[BaseModel], prefix: str = "", choices: dict | None = None) -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.append(f"| **`{prefix}{name}`** | section | | {field.description} |")
            out.extend(rows(ann, f"{prefix}{name}."))
            continue
        default = field.get_default(call_default_factory=True)
        text = (field.description or "").replace("|", "\\|")
        kind = _type(ann)
        if choices and not prefix and name in choices:  # computed at run time (the registry's)
            kind = " \\| ".join(f"`{v}`" for v in choices[name])
        out.append(f"| `{prefix}{name}` | {kind} | `{default!r}` | {text} |")
    return out


def reference() -> str:
    from parallel.registry import names, spec_class

    head = ["| field | type | default | meaning |", "|---|---|---|---|"]
    return "\n".join([BEGIN, *head, *rows(spec_class(), choices={"backend": names()}), END])


def update(readme: Path) -> None:
    """Replace the text between the markers in `readme` with the current reference."""
    text = readme.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    readme.write_text(text[:start] + reference() + text[end:])


if __name__ == "__main__":
    import sys

    if sys.argv[1:]:  # python -m parallel.spec.doc docs/spec.md
        update(Path(sys.argv[1]))
    else:
        print(reference())
