"""A DeepSpeed config's `tensor_parallel` block (AutoTP) as the spec's topology.tp and tp_plan,
keeping what DeepSpeed meant by it (docs/tp.md), or failing naming the key. Plain data: no deepspeed
import."""

from __future__ import annotations

from backends.deepspeed.config.autotp import plan_of
from parallel.interop.importing import Import




def tensor_parallel_section(imp: Import, block) -> None:
    """AutoTP: autotp_size is topology.tp, a partition_config that is a plan is topology.tp_plan
    (autotp.plan_of), and train_batch_size counted every rank of a TP group (DeepSpeedConfig takes
    the whole world when a config file alone enables AutoTP): the global batch is that over tp."""
    if block is None:
        return
    src = "tensor_parallel"
    if not isinstance(block, dict):
        imp.problems.append((src, f"{block!r} is not a JSON object"))
        return
    inner = block.get("tp", block.get("tensor_parallel")) or {}
    size = imp.whole(f"{src}.autotp_size", block.get("autotp_size", 0) or 0)
    if size is None or size <= 1:
        imp.note(src, "ignored", f"autotp_size {block.get('autotp_size', 0)}: AutoTP is off")
        return
    imp.set("topology.tp", size, f"{src}.autotp_size")
    gb = imp.spec.get("global_batch_size")
    if gb is not None and gb % size:
        imp.problems.append(("train_batch_size", f"{gb} counts each sample once per TP rank under "
                             f"AutoTP, and tensor_parallel.autotp_size {size} does not divide it"))
    elif gb is not None:
        imp.set("global_batch_size", gb // size, "train_batch_size", "mapped", f"global_batch_size:"
                f" {gb // size} ({gb} counts each sample on every one of the {size} TP ranks)")
    _tp_split(imp, block, inner)


def _tp_split(imp: Import, block: dict, inner: dict) -> None:
    """What picks AutoTP's split: a plan, or the defaults polyshard's own plan matches."""
    src, kept = "tensor_parallel", {}
    for key, value in block.items():
        where = f"{src}.{key}"
        if key == "partition_config" and value is not None:
            try:
                imp.set("topology.tp_plan", plan_of(value), where)
            except ValueError as err:
                imp.refuse(where, f"{err}; write topology.tp_plan ({{module path: colwise | "
                           "rowwise | colwise_rep})", lossy_ok=False)
        elif key in ("preset_model", "injection_policy_tuple", "kernel_inject",
                     "replace_with_kernel_inject") and value:
            imp.refuse(where, f"{value!r} picks AutoTP's split by DeepSpeed's own rules; write "
                       "topology.tp_plan, or leave it out (the model's own plan)", lossy_ok=False)
        elif key in ("vocab_parallel_lm_head",) and value or (
                key == "vocab_parallel_ce_backend" and value != "torch"):
            imp.refuse(where, f"{value!r}: a vocabulary-parallel head and loss of DeepSpeed's own; "
                       "polyshard's head is colwise_rep (logits gathered whole)", lossy_ok=False)
        elif key in ("tp", "tensor_parallel"):
            if int(inner.get("tp_grain_size", 1) or 1) != 1 or inner.get("mpu") or inner.get(
                    "tp_group"):
                imp.refuse(where, f"{value!r}: uneven shards or groups of your own", lossy_ok=False)
        elif key in ("tp_overlap_comm", "keep_module_on_host"):
            kept[key] = value
        elif key not in ("autotp_size", "dtype", "partition_config", "vocab_parallel_lm_head",
                         "vocab_parallel_ce_backend"):
            imp.note(where, "ignored", "not read by AutoTP training")
    if kept:
        imp.set("deepspeed.native.tensor_parallel", kept, src, "native", "kept verbatim for "
                "DeepSpeed (how AutoTP communicates and where it keeps the module)")
