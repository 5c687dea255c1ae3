"""DeepSpeed specs as accelerate and HF Trainer files, and any spec as a DeepSpeed JSON
(parallel/interop/export.py dispatches here)."""

from __future__ import annotations

import json

from backends.deepspeed.config.translate import exported, translate
from parallel.interop.exporting import common_accelerate, trainer_args, trainer_document
from parallel.spec.errors import SpecError, validate_as
from parallel.spec.model import Spec


def _accelerate_tp(spec: Spec, tool: str) -> None:
    """accelerate 1.11 runs DeepSpeed's AutoTP over a mesh of the first tp ranks only
    (`init_device_mesh(device, (tp,))` in _prepare_deepspeed; measured at 4 ranks, tp 2: ranks 2-3
    fail with IndexError), so under it AutoTP runs with tp = the world size, no data parallelism."""
    if spec.topology.tp > 1 and spec.dims.dp_size > 1:
        raise SpecError([("topology.tp", f"{spec.topology.tp} with {spec.dims.dp_size} data-parallel "
                          f"ranks: {tool} runs DeepSpeed's AutoTP over the first tp ranks only "
                          "(accelerate 1.11 builds a 1-D TP mesh; the other ranks fail), so only tp "
                          "= world size exports; run this one with polyshard launch")])


def _no_cp(spec: Spec, tool: str) -> None:
    if spec.topology.cp > 1:
        raise SpecError([("topology.cp", f"{spec.topology.cp}: {tool} runs no sequence parallelism "
                          "with DeepSpeed here (accelerate 1.11 has no sp_size; its cp_size is "
                          "FSDP2's); export --to deepspeed (sequence_parallel_size) or run it "
                          "with polyshard launch")])


def to_accelerate(spec: Spec) -> dict:
    _accelerate_tp(spec, "accelerate")
    _no_cp(spec, "accelerate")
    config = exported(translate(spec)["config"], auto=True)
    name = "deepspeed_config.json"
    common = common_accelerate(spec)
    del common["mixed_precision"]  # beside deepspeed_config_file accelerate refuses it: the JSON says
    return {**common, "distributed_type": "DEEPSPEED", "deepspeed_config": {
        "deepspeed_config_file": name, "zero3_init_flag": spec.deepspeed.zero_init,
        "deepspeed_multinode_launcher": "standard"},
        "__files__": {name: json.dumps(config, indent=2) + "\n"}}


def to_deepspeed(spec: Spec, auto: bool = False) -> dict:
    """Any spec as the DeepSpeed config it means (its other fields kept, backend deepspeed); the
    buckets polyshard sizes to the model as "auto" (`auto`: for HF Trainer) or left to DeepSpeed."""
    data = spec.model_dump(mode="json", exclude_unset=True)
    config = exported(translate(validate_as(type(spec), {**data, "backend": "deepspeed"}))["config"],
                      auto)
    cp = spec.topology.cp
    if cp > 1:  # DeepSpeed's own spelling: its train_batch_size then counts world / cp ranks
        config["sequence_parallel_size"] = cp
        if "train_batch_size" in config:
            config["train_batch_size"] //= cp
    return config


def to_hf_trainer(spec: Spec) -> dict:
    _accelerate_tp(spec, "HF Trainer (through accelerate)")
    _no_cp(spec, "HF Trainer (through accelerate)")
    return trainer_document({**trainer_args(spec), "deepspeed": to_deepspeed(spec, auto=True)})
