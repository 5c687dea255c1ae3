"""The README's spec reference, generated from the pydantic models (a unit test keeps them in sync).

    python -m parallel.spec.doc > /tmp/ref.md
"""

from __future__ import annotations

import typing
from pathlib import Path

from pydantic import BaseModel

from parallel.spec.model import Spec

BEGIN, END = "<!-- spec-reference:begin -->", "<!-- spec-reference:end -->"


def _type(annotation) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if args:
        return " \\| ".join(_type(a) for a in args)
    return getattr(annotation, "__name__", str(annotation)).replace("NoneType", "null")


def rows(model: type[BaseModel], prefix: str = "") -> list[str]:
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
        if callable(field.json_schema_extra):  # choices computed at run time (the registry's)
            schema: dict = {}
            field.json_schema_extra(schema)
            kind = " \\| ".join(f"`{v}`" for v in schema.get("enum", [])) or kind
        out.append(f"| `{prefix}{name}` | {kind} | `{default!r}` | {text} |")
    return out


def reference() -> str:
    head = ["| field | type | default | meaning |", "|---|---|---|---|"]
    return "\n".join([BEGIN, *head, *rows(Spec), END])


def update(readme: Path) -> None:
    """Replace the text between the markers in `readme` with the current reference."""
    text = readme.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    readme.write_text(text[:start] + reference() + text[end:])


if __name__ == "__main__":
    import sys

    if sys.argv[1:]:  # python -m parallel.spec.doc README.md
        update(Path(sys.argv[1]))
    else:
        print(reference())
