"""`polyshard import accelerate|deepspeed FILE` and `polyshard export --to
accelerate|deepspeed|hf-trainer`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

OUTCOME_STYLE = {"lost": "bold red", "ignored": "yellow", "launch": "dim", "default": "cyan",
                 "auto": "magenta", "absent": "cyan", "derived": "cyan"}


def add_parsers(sub, command, add_spec_args) -> None:
    p = command("import", "turn an accelerate config, a DeepSpeed JSON or a transformers "
                "DistributedConfig JSON into a spec that means the same; every source field is "
                "reported, and one that cannot keep its meaning stops the import (exit 2) naming "
                "it, unless --lossy")
    from parallel.registry import config_import_kinds, export_formats

    p.add_argument("kind", choices=["accelerate", "transformers", *config_import_kinds()])
    p.add_argument("file", help="accelerate config YAML, DeepSpeed JSON (hjson, as DeepSpeed "
                   "reads it), or transformers' DistributedConfig JSON (its to_json_file)")
    p.add_argument("-o", "--output", help="write the spec YAML here (default: stdout)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="what the file leaves to its caller (\"auto\") or its launch: e.g. --set "
                   "precision=bf16 --set topology.procs_per_node=8 (they win over the file)")
    p.add_argument("--lossy", action="store_true", help="import even where a field cannot keep its "
                   "meaning; each loss is listed as 'lost'")
    p = command("export", "write a spec as an accelerate config, a DeepSpeed JSON or HF "
                "TrainingArguments keyword arguments")
    p.add_argument("--to", required=True, choices=export_formats())
    add_spec_args(p)
    p.add_argument("-o", "--output", help="file to write (default: stdout); an accelerate export "
                   "of a DeepSpeed spec also writes the DeepSpeed JSON beside it")


def _read_yaml(path: Path):
    """An accelerate config (or a JSON one), read as data: a regular file, bounded, without YAML
    aliases."""
    from parallel.files import FileError, load_yaml
    from parallel.spec.errors import SpecError

    try:
        return load_yaml(path, "an accelerate config")
    except FileError as err:
        raise SpecError([(str(path), str(err).partition(": ")[2] + (
            "; YAML indents with spaces, never tabs" if "YAML" in str(err) else ""))]) from None


def run_import(args) -> int:
    from parallel.spec.io import SpecError, apply_override, load_spec

    source = Path(args.file)
    if not source.is_file():
        raise SpecError([(str(source), "no such file")])
    given: dict = {}
    for item in args.overrides:
        apply_override(given, item)
    if args.kind == "accelerate":
        from parallel.interop.accelerate import from_accelerate

        data, report = from_accelerate(_read_yaml(source), source.parent, args.lossy, given)
    elif args.kind == "transformers":
        from parallel.interop.distributed_config import from_distributed_config

        loaded = _read_yaml(source)  # JSON is YAML: the same bounded data reader
        if not isinstance(loaded, dict):
            raise SpecError([(str(source), "is not a JSON object: a DistributedConfig file is "
                              "one (DistributedConfig.to_json_file)")])
        data, report = from_distributed_config(loaded, load_spec, args.lossy, given)
    else:  # a kind a backend reads (its descriptor's config_importers)
        from parallel.registry import config_importer

        data, report = config_importer(args.kind)(source, args.lossy, given, load_spec)
    _merge(data, given)
    report += [(f"--set {item}", "set", "from the command line") for item in args.overrides]
    _print_report(source, report)
    load_spec(data)  # the result must itself be a valid spec (SpecError -> exit 2)
    text = yaml.safe_dump(data, sort_keys=False)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _merge(into: dict, given: dict) -> None:
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _print_report(source: Path, report) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # the file's own words are text, not markup: '*.[qkv]_proj' is no style tag
    lost = sum(1 for _, outcome, _ in report if outcome == "lost")
    table = Table(title=f"{escape(str(source))}: {len(report)} fields" + (
        f", [bold red]{lost} lost[/]" if lost else ""))
    for column in ("field", "outcome", "detail"):
        table.add_column(column, overflow="fold")
    for field, outcome, detail in report:
        style = OUTCOME_STYLE.get(outcome, "")
        table.add_row(escape(field), f"[{style}]{outcome}[/]" if style else outcome,
                      escape(detail))
    Console(stderr=True).print(table)


def run_export(args, spec) -> int:
    from parallel.interop.export import export

    result = export(spec, args.to)
    extra = result.pop("__files__", {}) if isinstance(result, dict) else {}
    text = (yaml.safe_dump(result, sort_keys=False) if args.to == "accelerate"
            else json.dumps(result, indent=2) + "\n")
    if args.output:
        Path(args.output).write_text(text)
        for name, content in extra.items():  # files the export refers to, beside it
            (Path(args.output).parent / name).write_text(content)
    else:
        sys.stdout.write(text)
        for name, content in extra.items():
            sys.stderr.write(f"# {name} (written beside the accelerate file with -o):\n{content}")
    return 0
