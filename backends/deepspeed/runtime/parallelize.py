"""DeepSpeed's model set-up as steps, each a function of the model, the config and plain options
(engine.py calls them in order; the config-level ones are unit-tested alone): start deepspeed.comm on
the engine's process group, build the model (under zero.Init for ZeRO-3 with a factory), hand AutoTP
the checked plan, `deepspeed.initialize`, and what polyshard keeps of DeepSpeed's own clipping.
"""

from __future__ import annotations

from contextlib import contextmanager

import os
import re

import torch
from torch import nn

from backends.deepspeed.config.autotp import with_plan
from backends.deepspeed.runtime.autotp_split import Split
from backends.deepspeed.runtime.ops import announce_builds, check_locks
from backends.deepspeed.config.translate import model_sized
from parallel.checkpoint.state import portable as ps
from parallel.engine.model.tp_plan import split_shapes
from parallel.spec.errors import SpecError


def start_deepspeed(local_rank: int, deepcompile: bool, device: torch.device, say) -> None:
    """deepspeed.comm over the process group the engine created: zero.Init reads its world size
    from there (before deepspeed.initialize it would see 1 and reject the batch sizes). DeepSpeed
    asserts LOCAL_RANK is exported (measured: "DeepSpeed requires the LOCAL_RANK environment
    variable" in a plain `python` process or a notebook); the engine knows it already (torchrun's,
    Slurm's SLURM_LOCALID, or 0 for one process started by hand). On CPU, init_distributed builds
    DeepSpeed's shared-memory op on first use: said first, and a killed build's lock refused
    (ops.py)."""
    import deepspeed

    check_locks()
    if device.type == "cpu":
        announce_builds(["deepspeed_shm_comm"], say)
    deepspeed.init_distributed(dist_init_required=False)
    # DeepSpeed keeps the last pipeline engine's grid as its model-parallel unit in a module
    # global until the group is destroyed; a plain engine after one in the same process read its
    # model-parallel size from there and failed (measured: "'NoneType' object has no attribute
    # 'get_model_parallel_rank'"). Each engine starts from none; a PipelineModule sets its own.
    from deepspeed.utils import groups

    groups.mpu = None
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    if deepcompile and device.type != "cuda":
        raise SpecError([("deepspeed.deepcompile", f"needs CUDA: DeepSpeed "
                          f"{deepspeed.__version__} enables DeepCompile on the cuda accelerator "
                          f"only, and this process runs on {device.type}; set "
                          "deepcompile: false (compile.enabled still compiles the model)")])


def known_config(config: dict) -> dict:
    """The config without the model-sized "auto" values (filled after construction; zero.Init
    reads none of them)."""
    return {**config, "zero_optimization": {
        k: v for k, v in config.get("zero_optimization", {}).items() if not model_sized(v)}}


def build_model(model, config: dict, zero3: bool, zero_init: bool):
    """The model built. With ZeRO-3 and zero_init, parameters are partitioned as each module is
    constructed: no rank holds them all. transformers sees ZeRO-3 meanwhile, so a factory calling
    from_pretrained loads the weights into the partitions as Hugging Face does under ZeRO-3
    (without it: "Cannot copy out of meta tensor"); after a plain build, from_pretrained stays as
    written."""
    import deepspeed

    if isinstance(model, nn.Module):
        return model
    if not (zero_init and zero3):
        return model()
    with zero3_visible(config), deepspeed.zero.Init(config_dict_or_path=config):
        model = model()
    _reinit_partitioned(model)
    return model


def apply_autotp_plan(config: dict, model: nn.Module, tp: int, plan: dict[str, str]
                      ) -> tuple[dict, dict]:
    """(the config with AutoTP's partition_config from the checked plan, each split parameter's
    expected shape on one TP rank), so DeepSpeed splits exactly what FSDP2 and XLA split."""
    if any(k.endswith(".base_layer") for k in plan):  # measured (#42)
        raise SpecError([("topology.tp", "DeepSpeed 0.19.8's AutoTP does not split PEFT's LoRA "
                          "layers as planned (measured on a Llama: q_proj and v_proj's base layers "
                          "and lora_B stayed whole while o_proj and down_proj split); LoRA with "
                          "tensor parallelism runs on backend: fsdp (FSDP2), within 1e-5 of one "
                          "process")])
    expected = {ps.clean_name(n): shape for n, shape, _ in split_shapes(model, tp, plan)}
    return with_plan(config, plan), expected


def apply_zero(model: nn.Module, client: torch.optim.Optimizer, config: dict):
    """deepspeed.initialize over the client optimizer built by polyshard (the same checks as on
    every backend; ZeRO keeps the parameter objects: groups built before prepare need no
    mapping). Returns (DeepSpeedEngine, its optimizer)."""
    import deepspeed

    ds, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=client,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config, dist_init_required=False)
    return ds, ds_optimizer


def checked_split(ds, expected: dict) -> Split:
    """What AutoTP split, every parameter's shape checked against the plan's."""
    names = {id(p): ps.clean_name(n) for n, p in ds.module.named_parameters()}
    split = Split(ds.module, names)
    split.check(ds.module, expected, names)
    return split


def _reinit_partitioned(model: nn.Module) -> None:
    """Hugging Face models initialise their weights in `post_init`, which under zero.Init runs on
    already-partitioned (empty) parameters, so the init is lost (measured: step-1 loss 5.767 instead
    of 5.548, docs/deepspeed.md). Re-run the model's own `_init_weights` on gathered parameters, in
    the same module order, so the weights equal those of a plain construction with the same seed."""
    init = getattr(model, "_init_weights", None)
    if init is None or any(getattr(p, "_is_hf_initialized", False) for p in model.parameters()):
        return  # from_pretrained under HfDeepSpeedConfig loaded (and initialised) it already
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        model.apply(init)


@contextmanager
def zero3_visible(config: dict):
    """transformers sees ZeRO-3 (HfDeepSpeedConfig: `is_deepspeed_zero3_enabled()` true) for the
    length of the block only: while the model is built (from_pretrained partitions) and while the
    user calls it unwrapped (generate keeps ranks in step: synced_gpus). Not beyond: a process that
    saw it after a job, as Hugging Face's own integration leaves it, entered zero.Init in a plain
    from_pretrained on one rank and waited for ever in a broadcast no other rank joined
    (measured)."""
    try:
        from transformers.integrations import HfDeepSpeedConfig
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    except ImportError:
        yield
        return
    held = HfDeepSpeedConfig(config)  # transformers keeps a weak reference: held here
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del held


def check_arch_list(value: str) -> None:
    """DeepCompile builds a CUDA op on first use, and DeepSpeed 0.19.8's JIT builder reads each
    TORCH_CUDA_ARCH_LIST entry as MAJOR.MINOR[+PTX]: torch's arch-specific '9.0a' (sm_90a) failed
    deep inside it with "invalid literal for int() with base 10: '0a'" (measured on an H100 image
    that exports it; with 9.0 the same job ran). Said before DeepSpeed starts building."""
    bad = [e for e in value.replace(" ", ";").split(";")
           if e.strip() and not re.fullmatch(r"\d+\.\d+(\+PTX)?", e.strip())]
    if bad:
        raise RuntimeError(f"TORCH_CUDA_ARCH_LIST={value!r}: deepspeed.deepcompile builds DeepSpeed's "
                           f"op, whose builder reads each entry as MAJOR.MINOR[+PTX], and {bad} are "
                           "not; export the list without arch suffixes (e.g. 9.0 for 9.0a) or unset "
                           "it (DeepSpeed then asks the GPU)")


def keep_clipped_norm(ds) -> None:
    """ZeRO-0 in fp32 clips inside `ds.step()` (DeepSpeedEngine.clip_fp32_gradients: its
    clip_grad_norm_, which sums AutoTP's shards over the TP group through `ds.mpu`) and drops the
    norm it computed. This instance keeps it as `ds.clipped_norm`, so reporting the norm costs no
    second norm and no second all-reduce (the same call as DeepSpeed's, its result kept)."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip():
        ds.clipped_norm = clip_grad_norm_(parameters=ds.module.parameters(),
                                          max_norm=ds.gradient_clipping(), mpu=ds.mpu)

    ds.clipped_norm = None
    ds.clip_fp32_gradients = clip
