"""torch FSDP's memory and communication model for `polyshard plan` (the descriptor's PlanModel).

FSDP keeps fp32 sharded parameters and casts per unit for compute. SHARD_GRAD_OP reshards after
backward like FULL_SHARD, so both hold sharded states between steps (grad_op keeps full parameters
only transiently). FSDP2 pads each parameter's dim 0 to the shard count, FSDP1 the flat concatenation.
"""

from __future__ import annotations

from parallel.kits.sizes import flat, numel, per_param_dim0


def model_states(spec, shapes, n: int, low: int, opt: int) -> tuple[float, float, float]:
    if spec.shard == "none":
        part = numel(shapes)
    else:
        part = (per_param_dim0 if spec.fsdp.version == 2 else flat)(shapes, n)
    return 4.0 * part, 4.0 * part, float(opt * part)


def transient(spec, psi: float, unit: float, low: int, hidden: int | None = None
              ) -> tuple[float, float]:
    """FULL_SHARD / HYBRID: the unit computing and the one prefetched, gathered in the compute
    dtype. SHARD_GRAD_OP keeps every unit gathered from its forward to its backward, so at the
    end of forward the whole model is held gathered. NO_SHARD holds its parameters as state.
    Buffers: one unit's unsharded gradient in the reduce dtype before its reduce-scatter (or
    all-reduce). topology.pp (`psi`: the rank's stages): torch's schedules keep every stage
    gathered from its first backward to its last, and its unsharded gradients accumulating
    until the last reduces them (set_reshard_after_backward / set_requires_gradient_sync False):
    the rank's whole stages in both (measured by `polyshard dryrun`, docs/pipeline.md)."""
    red = {"fp32": 4, "bf16": 2, "fp16": 2}[spec.grad_reduce_dtype]
    if spec.topology.pp > 1 and spec.shard != "none":
        return psi * low, psi * red
    if spec.shard == "none":
        return 0.0, unit * red
    gathered = psi * low if spec.shard in ("grad_op", "hybrid_grad_op") else 2 * unit * low
    return gathered, unit * red


def comm(spec, psi: float, output_share: float = 0.0, root_share: float = 0.0) -> float:
    """NO_SHARD all-reduces (2 Psi), SHARD_GRAD_OP gathers once and reduce-scatters (2 Psi),
    FULL_SHARD gathers again in backward (3 Psi) -- except what stays gathered from forward into
    backward: FSDP2's output unit (final norm and output layer, backends/fsdp/layout.py) unless
    fsdp.reshard_output, FSDP1's root unit (embeddings, final norm, head: FSDP1 never reshards
    the root after forward; measured by `polyshard dryrun`, tests/distributed/test_dryrun.py):
    3 Psi less its share. Measured in tests/distributed/test_bench_plan.py too."""
    if spec.shard in ("none", "grad_op"):
        return 2.0
    if spec.fsdp.version == 1:
        return 3.0 - root_share
    return 3.0 - (0.0 if spec.fsdp.reshard_output else output_share)
