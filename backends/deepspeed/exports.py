"""DeepSpeed specs as accelerate and HF Trainer files, and any spec as a DeepSpeed JSON
(parallel/interop/export.py dispatches here)."""

from __future__ import annotations

import json

from backends.deepspeed.translate import translate
from parallel.interop.export import common_accelerate, trainer_args, trainer_document
from parallel.spec.io import load_spec
from parallel.spec.model import Spec


def to_accelerate(spec: Spec) -> dict:
    config = translate(spec)["config"]
    name = "deepspeed_config.json"
    common = common_accelerate(spec)
    del common["mixed_precision"]  # beside deepspeed_config_file accelerate refuses it: the JSON says
    return {**common, "distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_config_file": name, "zero3_init_flag": spec.deepspeed.zero_init,
        "deepspeed_multinode_launcher": "standard"},
        "__files__": {name: json.dumps(config, indent=2) + "\n"}}


def to_deepspeed(spec: Spec) -> dict:
    """Any spec as the DeepSpeed config it means (its other fields kept, backend deepspeed)."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    return translate(load_spec({**data, "backend": "deepspeed"}))["config"]


def to_hf_trainer(spec: Spec) -> dict:
    return trainer_document({**trainer_args(spec), "deepspeed": to_deepspeed(spec)})
