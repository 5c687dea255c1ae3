"""A spec as the files other tools take (`polyshard export --to FORMAT`): an accelerate config, a
DeepSpeed JSON, HF `TrainingArguments` keyword arguments. A dispatcher: the spec's backend writes its
own (its descriptor's exports), or a backend that converts any spec to the format does
(parallel/registry.py); the vocabulary they share is parallel/interop/exporting.py."""

from __future__ import annotations

from parallel.spec.errors import SpecError
from parallel.spec.model import Spec


def export(spec: Spec, fmt: str) -> dict:
    """`spec` as format `fmt` (accelerate, hf-trainer, or a format a backend converts any spec to)."""
    from parallel.registry import exporter

    if spec.topology.pp > 1:  # no file of these tools says "pipeline stages"
        raise SpecError([("topology.pp", f"{spec.topology.pp}: {fmt} files carry no pipeline "
                          "stages (accelerate 1.11 pipelines inference only, HF Trainer not at all, "
                          "and DeepSpeed builds its stages in code, a PipelineModule, not from its "
                          "config), so the export would train without them; run this spec with "
                          "polyshard launch")])
    return exporter(fmt, spec.backend)(spec)


def formats() -> list[str]:
    from parallel.registry import export_formats

    return export_formats()
