"""`polyshard import accelerate|deepspeed FILE` and `polyshard export --to accelerate|deepspeed|hf-trainer`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml


def add_parsers(sub, command, add_spec_args) -> None:
    p = command("import", "turn an accelerate config or a DeepSpeed JSON into a spec; every field "
                "is reported mapped, a launch flag, ignored or unsupported")
    p.add_argument("kind", choices=["accelerate", "deepspeed"])
    p.add_argument("file", help="accelerate config YAML, or DeepSpeed JSON")
    p.add_argument("-o", "--output", help="write the spec YAML here (default: stdout)")
    p = command("export", "write a spec as an accelerate config, a DeepSpeed JSON or HF "
                "TrainingArguments keyword arguments")
    p.add_argument("--to", required=True, choices=["accelerate", "deepspeed", "hf-trainer"])
    add_spec_args(p)
    p.add_argument("-o", "--output", help="file to write (default: stdout)")


def run_import(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from parallel.interop import from_accelerate, from_deepspeed
    from parallel.specio import load_spec

    source = Path(args.file)
    if args.kind == "accelerate":
        def read_json(name):
            return json.loads((source.parent / name).read_text())

        data, report = from_accelerate(yaml.safe_load(source.read_text()) or {}, read_json)
    else:
        data, report = from_deepspeed(json.loads(source.read_text()))
    load_spec(data)  # the result must itself be a valid spec (SpecError -> exit 2)
    table = Table(title=f"{source}: {len(report)} fields")
    for column in ("field", "outcome", "detail"):
        table.add_column(column)
    for field, outcome, detail in report:
        style = {"unsupported": "red", "ignored": "dim"}.get(outcome, "")
        table.add_row(field, f"[{style}]{outcome}[/]" if style else outcome, detail)
    Console(stderr=True).print(table)
    text = yaml.safe_dump(data, sort_keys=False)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def run_export(args, spec) -> int:
    from parallel.interop_export import EXPORTERS

    result = EXPORTERS[args.to](spec)
    text = (yaml.safe_dump(result, sort_keys=False) if args.to == "accelerate"
            else json.dumps(result, indent=2) + "\n")
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
