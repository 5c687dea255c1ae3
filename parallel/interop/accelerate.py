"""`accelerate config` files as specs (`polyshard import accelerate FILE`), meaning what accelerate
meant by them.

The rule (as for DeepSpeed JSON, backends/deepspeed/files/interop.py): every field keeps its meaning, or the
import fails naming the field, why and the fix; `--lossy` accepts such losses and reports them. A key
the file leaves out means what `accelerate launch` 1.11 does without it (measured with accelerate's own
launcher and plugin classes: tests/unit/test_real_configs.py), written into the spec explicitly:
FSDP wraps nothing, FSDP1 does not prefetch in backward, cpu_ram_efficient_loading is on, the state
dict is FULL (v1) or SHARDED (v2). A key accelerate does not read is reported (and refused with a
did-you-mean when it is close to one it reads). Plain data: accelerate is not imported.

A dispatcher: the section of the file a backend reads is handed to that backend (registry); what the
readers share is parallel/interop/importing.py.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from parallel.interop.importing import PARALLELISM, Import, Report
from parallel.spec.errors import SpecError

TOP_LEVEL = {  # accelerate 1.11's ClusterConfig fields; it refuses any other key
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug",
    "num_processes", "machine_rank", "num_machines", "gpu_ids", "main_process_ip",
    "main_process_port", "rdzv_backend", "same_network", "main_training_function",
    "enable_cpu_affinity", "fp8_config", "deepspeed_config", "fsdp_config", "parallelism_config",
    "megatron_lm_config", "ipex_config", "mpirun_config", "downcast_bf16", "tpu_name", "tpu_zone",
    "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "dynamo_config", "fp16", "dynamo_backend"}  # the last two: old names it still converts
PRECISION = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}
LAUNCH_ONLY = {"machine_rank": "polyshard launch --node-rank (per node)",
               "rdzv_backend": "polyshard launch uses torchrun's c10d rendezvous",
               "same_network": "polyshard launch uses torchrun's c10d rendezvous",
               "compute_environment": "LOCAL_MACHINE: polyshard launch, or --emit slurm|k8s",
               "debug": "not a training setting", "main_training_function": "notebooks only",
               "enable_cpu_affinity": "not a training setting",
               "tpu_name": "polyshard launch --emit tpu-vm --tpu", "tpu_zone": "--emit tpu-vm --zone",
               "tpu_use_cluster": "--emit tpu-vm runs on every worker", "tpu_use_sudo": "not a "
               "training setting", "tpu_env": "TPU VM environment: --emit tpu-vm",
               "command_file": "TPU VM set-up commands", "commands": "TPU VM set-up commands",
               "tpu_vm": "TPU VM names"}
EMPTY_OK = {"fp8_config", "megatron_lm_config", "ipex_config", "mpirun_config", "dynamo_config",
            "parallelism_config"}


def from_accelerate(cfg: Any, base: Path | None = None, lossy: bool = False,
                    given: dict | None = None) -> tuple[dict, Report]:
    """An accelerate config (the YAML as a dict) -> (spec dict, report). `base`: the YAML's
    directory, where files it names (a deepspeed_config_file) are read. Raises SpecError naming what
    cannot be kept."""
    if not isinstance(cfg, dict) or not cfg:
        raise SpecError([("<file>", "is empty or not a mapping: an accelerate config is a YAML "
                          "mapping with at least distributed_type")])
    if "zero_optimization" in cfg or "train_micro_batch_size_per_gpu" in cfg:
        raise SpecError([("<file>", "looks like a DeepSpeed JSON config: use `polyshard import "
                          "deepspeed FILE`")])
    from parallel.spec.io import load_spec

    imp = Import(lossy, given or {}, load_spec)
    kind = str(cfg.get("distributed_type", "NO")).upper()
    _top_level(imp, cfg, kind)
    from parallel.registry import accelerate_reader

    section = accelerate_reader(kind, cfg)
    if section is None:
        imp.problems.append(("distributed_type", f"{kind!r}: no polyshard backend reads it (FSDP, "
                             "DEEPSPEED, XLA with fsdp_config xla: true, and data parallel MULTI_* / "
                             "NO are read; there is no Megatron or other engine here)"))
    else:
        section(imp, cfg, base)
    return imp.finish()


def _top_level(imp: Import, cfg: dict, kind: str) -> None:
    from parallel.registry import accelerate_keys

    for key, value in cfg.items():
        if key not in TOP_LEVEL and key not in accelerate_keys():
            hint = difflib.get_close_matches(key, sorted(TOP_LEVEL), n=1, cutoff=0.75)
            imp.problems.append((key, "accelerate's ClusterConfig refuses this key" + (
                f"; did you mean {hint[0]!r}?" if hint else "")))
        elif key in LAUNCH_ONLY:
            imp.note(key, "launch", LAUNCH_ONLY[key])
        elif key in EMPTY_OK and value and key not in ("parallelism_config", "dynamo_config"):
            imp.refuse(key, f"{key} has no polyshard equivalent (fp8, Megatron, IPEX, MPI)")
    _precision(imp, cfg)
    _dynamo(imp, cfg)
    _topology(imp, cfg, kind)
    if cfg.get("use_cpu"):
        imp.refuse("use_cpu", "true trains on the CPU even where GPUs exist; polyshard uses the "
                   "host's accelerator")
    ids = cfg.get("gpu_ids")
    if ids not in (None, "all"):
        imp.refuse("gpu_ids", f"{ids!r} picks GPUs: export CUDA_VISIBLE_DEVICES={ids} before "
                   "polyshard launch")
    if cfg.get("downcast_bf16") not in (None, False, "no"):
        imp.refuse("downcast_bf16", "downcasts fp32 tensors to bf16 on TPUs, which changes the math "
                   "on no other backend")


DYNAMO_BACKENDS = {"INDUCTOR": "inductor", "AOT_EAGER": "aot_eager", "EAGER": "eager"}


def _dynamo(imp: Import, cfg: dict) -> None:
    """dynamo_config, as `accelerate launch` hands it to its TorchDynamoPlugin: backend NO is off;
    the whole model is compiled unless dynamo_use_regional_compilation; fullgraph defaults false;
    dynamic false unless set."""
    dyn = dict(cfg.get("dynamo_config") or {})
    if "dynamo_backend" in cfg:  # accelerate's old top-level name for the same field
        dyn.setdefault("dynamo_backend", cfg["dynamo_backend"])
    src = "dynamo_config.dynamo_backend"
    backend = str(dyn.get("dynamo_backend", "NO")).upper()
    if backend == "NO":
        return
    if backend not in DYNAMO_BACKENDS:
        imp.refuse(src, f"{backend!r}: polyshard compiles with inductor, aot_eager or eager "
                   "(compile.backend)")
        return
    imp.set("compile.enabled", True, src)
    imp.set("compile.backend", DYNAMO_BACKENDS[backend], src)
    regional = bool(dyn.get("dynamo_use_regional_compilation", False))
    imp.set("compile.scope", "blocks" if regional else "model",
            "dynamo_config.dynamo_use_regional_compilation", detail=(
                "compile.scope: 'blocks' (accelerate also compiles the modules outside the repeated "
                "blocks, each on its own; polyshard runs those eagerly)" if regional else
                "compile.scope: 'model' (accelerate compiles the whole model unless regional)"))
    # accelerate launch's own defaults (its --dynamo_* arguments) fill what the file leaves out:
    # dynamic is then False, not torch's None
    for key, field, default in (("dynamo_mode", "mode", "default"),
                                ("dynamo_use_fullgraph", "fullgraph", False),
                                ("dynamo_use_dynamic", "dynamic", False)):
        imp.set(f"compile.{field}", dyn.get(key, default), f"dynamo_config.{key}")


def _precision(imp: Import, cfg: dict) -> None:
    value = cfg.get("mixed_precision")
    if value is None and "fp16" in cfg:  # accelerate's old format
        value = "fp16" if cfg["fp16"] else "no"
    value = "no" if value is None else str(value).lower()
    if value not in PRECISION:
        imp.problems.append(("mixed_precision", f"{value!r}: polyshard computes in fp32 ('no'), "
                             "bf16 or fp16 (fp8 has no equivalent)"))
        return
    imp.set("precision", PRECISION[value], "mixed_precision",
            outcome="mapped" if "mixed_precision" in cfg or "fp16" in cfg else "default")


def _topology(imp: Import, cfg: dict, kind: str) -> None:
    machines = cfg.get("num_machines")
    machines = imp.whole("num_machines", 1 if machines is None else machines)
    procs = cfg.get("num_processes")
    if procs not in (None, -1):
        procs = imp.whole("num_processes", procs)
    if machines is None or procs is None and cfg.get("num_processes") is not None:
        return  # named in imp.problems
    if machines < 1 or (procs is not None and procs < -1):
        imp.problems.append(("num_machines" if machines < 1 else "num_processes",
                             f"{machines if machines < 1 else procs}: a count of at least 1"))
        return
    if kind == "NO":
        imp.set("topology.nodes", 1, "distributed_type", detail="NO: one process")
        imp.set("topology.procs_per_node", 1, "num_processes", "default",
                f"distributed_type NO launches one process (num_processes {procs!r} unused)")
        return
    if procs in (None, -1):
        imp.note("num_processes", "launch", "not set: pass --nproc to polyshard launch")
    elif int(procs) % machines:
        imp.problems.append(("num_processes", f"{procs} processes over {machines} machines: "
                             "accelerate's num_processes counts all machines; use a multiple"))
    else:
        imp.set("topology.nodes", machines, "num_machines")
        imp.set("topology.procs_per_node", int(procs) // machines, "num_processes",
                detail="num_processes / num_machines (accelerate counts all machines)")
    ip, port = cfg.get("main_process_ip"), cfg.get("main_process_port")
    if ip is not None and machines > 1:
        imp.set("topology.rdzv_endpoint", f"{ip}:{port or 29500}", "main_process_ip",
                detail="rendezvous of a multi-node job")
    elif ip is not None or port is not None:
        imp.note("main_process_ip / main_process_port", "launch", "one machine: polyshard launch "
                 "picks a free port")


def from_parallelism_config(config, accelerate_config: dict | None = None, lossy: bool = False,
                            given: dict | None = None) -> tuple[dict, Report]:
    """accelerate's ParallelismConfig object (its sizes as its class resolved them) in
    `accelerate_config` (default: FSDP2, accelerate's only FSDP that takes one; a DEEPSPEED config
    for sp_size), read as that file would be: (spec dict, report)."""
    fields = config.to_json() if hasattr(config, "to_json") else dict(config)
    sizes = {f"parallelism_config_{k}": v for k, v in fields.items()
             if k in PARALLELISM and v is not None}
    cfg = dict(accelerate_config or {"distributed_type": "FSDP",
                                     "fsdp_config": {"fsdp_version": 2}})
    cfg["parallelism_config"] = {**(cfg.get("parallelism_config") or {}), **sizes}
    if getattr(config, "total_size", 1) > 1:  # the world its mesh spans, as accelerate checks it
        cfg.setdefault("num_processes", config.total_size)
    return from_accelerate(cfg, lossy=lossy, given=given)
