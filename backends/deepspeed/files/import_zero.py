"""A DeepSpeed config's zero_optimization block as spec fields (backends/deepspeed/files/interop.py holds
the rule: every field keeps its meaning, or the import fails naming it). Also read by accelerate's
deepspeed_config (backends/deepspeed/files/accelerate.py)."""

from __future__ import annotations

from backends.deepspeed.config import schema
from parallel.interop.importing import Import

SHARD_OF_STAGE = {0: "none", 1: "optimizer", 2: "grad_op", 3: "full"}


def zero_section(imp: Import, zero) -> None:
    if zero is None:
        imp.set("shard", "none", "zero_optimization", "default", "absent: ZeRO-0 (DeepSpeed's "
                "default), shard: none")
        imp.set("deepspeed.gather_16bit_weights_on_model_save", False, "zero_optimization", "default",
                "absent: no 16-bit gather on save (DeepSpeed's default)")
        return
    if not isinstance(zero, dict):
        imp.problems.append(("zero_optimization", f"must be an object, not {zero!r}"))
        return
    imp.problems += schema.zero_key_problems(zero, "zero_optimization")
    fields = {schema.ZERO_DEPRECATED.get(k, schema.field_of(k)): (k, v) for k, v in zero.items()}
    for name in ("offload_optimizer", "offload_param"):  # cpu_offload / cpu_offload_param: true
        key, value = fields.get(name, (None, None))
        if isinstance(value, bool):  # DeepSpeed 0.19.8 still reads them as a CPU offload block
            fields[name] = (key, {"device": "cpu"} if value else None)
    if "pin_memory" in fields:  # cpu_offload_use_pin_memory: DeepSpeed warns and sets nothing
        imp.note(f"zero_optimization.{fields.pop('pin_memory')[0]}", "ignored", "deprecated; "
                 "DeepSpeed 0.19.8 reads it into no setting (offload blocks pin by default)")
    stage = fields.pop("stage", ("stage", 0))[1]
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in SHARD_OF_STAGE:
        imp.problems.append(("zero_optimization.stage", f"{stage!r} is no ZeRO stage; use 0, 1, 2 "
                             "or 3"))
        return
    hpz = fields.pop("zero_hpz_partition_size", (None, 1))[1]
    if _wrong_type(hpz):
        imp.problems.append(("zero_optimization.zero_hpz_partition_size", _wrong_type(hpz)))
    elif stage == 3 and hpz not in (1, None, "auto"):
        imp.set("shard", "hybrid", "zero_optimization.zero_hpz_partition_size")
        imp.set("topology.shard_group_size", int(hpz), "zero_optimization.zero_hpz_partition_size")
    else:
        imp.set("shard", SHARD_OF_STAGE[stage], "zero_optimization.stage")
    param = fields.pop("offload_param", (None, None))[1]
    if stage != 3 and isinstance(param, dict) and param.get("device", "none") != "none":
        # DeepSpeed hands offload_param to ZeRO-3 only; stages 0-2 never read it
        imp.note("zero_optimization.offload_param", "ignored", f"ZeRO-{stage} does not read it: "
                 "DeepSpeed offloads parameters at stage 3 only")
        param = None
    _offload(imp, fields.pop("offload_optimizer", (None, None))[1], param)
    _zero_knobs(imp, fields)


# DeepSpeed 0.19.8's default (runtime/zero/config.py) where the spec's own differs: the reduce bucket
DEEPSPEED_DEFAULTS = {"reduce_bucket_size": 500_000_000}


def _zero_knobs(imp: Import, fields: dict) -> None:
    """The knobs the spec has fields for; the rest verbatim under deepspeed.native."""
    spec_fields = {"reduce_bucket_size": "deepspeed.reduce_bucket_size",
                   "prefetch_bucket_size": "deepspeed.prefetch_bucket_size",
                   "param_persistence_threshold": "deepspeed.param_persistence_threshold",
                   "gather_16bit_weights_on_model_save": "deepspeed.gather_16bit_weights_on_model_save"}
    for field, path in spec_fields.items():
        key, value = fields.pop(field, (None, None))
        source = f"zero_optimization.{key or schema.json_key(field)}"
        wrong = _wrong_type(value)
        if wrong:  # a list or mapping where DeepSpeed's config model takes a number or a flag
            imp.problems.append((source, wrong))
        elif value == "auto" and field == "gather_16bit_weights_on_model_save":
            imp.set(path, False, source, "auto", "auto: false (accelerate fills it so; DeepSpeed "
                    "drops \"auto\" and defaults to false)")
        elif value == "auto" and key == schema.json_key(field):  # the spelling HF fills
            imp.set(f"deepspeed.native.zero_optimization.{key}", "auto", source, "auto",
                    "filled at prepare from the model's hidden_size h as Hugging Face and accelerate "
                    "fill it (reduce h*h, prefetch 0.9*h*h, persistence 10*h)")
        elif value == "auto" and field in DEEPSPEED_DEFAULTS:  # kept: the spec's own is sized
            imp.set(path, DEEPSPEED_DEFAULTS[field], source, "auto", "under this spelling neither "
                    "Hugging Face nor accelerate fills it; DeepSpeed drops \"auto\" and uses its "
                    f"default {DEEPSPEED_DEFAULTS[field]:.0e}, and so does the spec")
        elif value == "auto":
            imp.note(source, "auto", "under this spelling neither Hugging Face nor accelerate fills "
                     "it; DeepSpeed drops \"auto\" and uses its default, and so does the spec")
        elif value is not None:
            imp.set(path, value if isinstance(value, bool) else int(value), source)
        elif field == "gather_16bit_weights_on_model_save":
            imp.set(path, False, source, "default", "absent: DeepSpeed's default false")
        elif field in DEEPSPEED_DEFAULTS:  # absent: DeepSpeed's default, kept (the spec's own
            # default is no larger than the model)
            imp.set(path, DEEPSPEED_DEFAULTS[field], source, "default",
                    f"absent: DeepSpeed's default {DEEPSPEED_DEFAULTS[field]:.0e}, kept as the file "
                    "means it (a spec without it sizes it to the model: docs/deepspeed.md)")
    for field, (key, value) in fields.items():
        if value == "auto":
            imp.note(f"zero_optimization.{key}", "auto", "DeepSpeed drops \"auto\" and uses its "
                     "default; so does the spec")
        else:
            imp.set(f"deepspeed.native.zero_optimization.{schema.json_key(field)}", value,
                    f"zero_optimization.{key}", "native", "kept verbatim for DeepSpeed")


def _wrong_type(value) -> str | None:
    """Why DeepSpeed's own config model would refuse `value` for a number or flag field, or
    None: absent, "auto", a flag, a number, or a string of a whole number (pydantic's lax int)."""
    if value is None or value == "auto" or isinstance(value, (bool, int, float)):
        return None
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return None
    return (f"{value!r}: DeepSpeed takes a number (or \"auto\", or true / false for a flag) "
            "here; write one")


def _offload(imp: Import, optimizer, param) -> None:
    blocks = {"offload_optimizer": optimizer, "offload_param": param}
    devices = {k: (b or {}).get("device", "none") if isinstance(b, dict) else "none"
               for k, b in blocks.items()}
    bad = {k: d for k, d in devices.items() if not isinstance(d, str)}
    if bad:  # DeepSpeed's OffloadDeviceEnum takes none, cpu or nvme
        for k, d in bad.items():
            imp.problems.append((f"zero_optimization.{k}.device", f"{d!r}: DeepSpeed offloads to "
                                 "\"none\", \"cpu\" or \"nvme\""))
        return
    if devices["offload_param"] != "none" and devices["offload_optimizer"] == "none":
        imp.refuse("zero_optimization.offload_param", "offloads parameters but not the optimizer; "
                   "polyshard's offload: params moves both (as FSDP's CPU offload does): add "
                   "offload_optimizer with the same device")
    on = {d for d in devices.values() if d != "none"}
    if len(on) > 1:
        imp.problems.append(("zero_optimization.offload_param.device", f"{devices}: polyshard "
                             "offloads to one device; use the same for both"))
    if not on:
        return
    level = "params" if devices["offload_param"] != "none" else "optimizer"
    device = on.pop()
    if device not in ("cpu", "nvme"):
        imp.problems.append(("zero_optimization.offload_optimizer.device", f"{device!r}: DeepSpeed "
                             "offloads to cpu or nvme"))
        return
    block = "offload_param" if level == "params" else "offload_optimizer"
    imp.set("offload", level, f"zero_optimization.{block}.device")
    if device == "nvme":
        imp.set("deepspeed.offload_device", "nvme", "zero_optimization.offload_*.device")
    _offload_details(imp, blocks)


def _offload_details(imp: Import, blocks: dict) -> None:
    pins = {b.get("pin_memory", True) for b in blocks.values() if isinstance(b, dict)
            and b.get("device", "none") != "none"}
    if len(pins) > 1:
        imp.problems.append(("zero_optimization.offload_param.pin_memory", "differs from "
                             "offload_optimizer.pin_memory; polyshard pins both or neither"))
    elif pins:
        pin = pins.pop()
        outcome = "mapped" if any("pin_memory" in (b or {}) for b in blocks.values()) else "default"
        imp.set("pin_memory", bool(pin), "zero_optimization.offload_*.pin_memory", outcome,
                f"pin_memory: {bool(pin)}" + (" (absent: DeepSpeed's default true)"
                                              if outcome == "default" else ""))
    paths = {b.get("nvme_path") for b in blocks.values() if isinstance(b, dict) and b.get("nvme_path")}
    if len(paths) > 1:
        imp.problems.append(("zero_optimization.offload_param.nvme_path", "differs from "
                             "offload_optimizer.nvme_path; polyshard takes one nvme_path"))
    elif paths:
        imp.set("deepspeed.nvme_path", paths.pop(), "zero_optimization.offload_*.nvme_path")
    for name, block in blocks.items():
        rest = {k: v for k, v in (block or {}).items() if k not in ("device", "pin_memory",
                                                                    "nvme_path") and v != "auto"}
        if rest and isinstance(block, dict) and block.get("device", "none") != "none":
            imp.set(f"deepspeed.native.zero_optimization.{name}", rest, f"zero_optimization.{name}",
                    "native", f"kept verbatim for DeepSpeed: {sorted(rest)}")
