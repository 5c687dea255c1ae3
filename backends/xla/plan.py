"""XLA FSDP's memory and communication model for `polyshard plan`: fp32 sharded parameters like
torch FSDP, each flat parameter padded to a multiple of 128 x the shard count (XLA FSDP's own rule)."""

from __future__ import annotations

from parallel.kits.sizes import flat_padded, numel

PAD = 128


def model_states(spec, shapes, n: int, low: int, opt: int) -> tuple[float, float, float]:
    part = numel(shapes) if spec.shard == "none" else flat_padded(shapes, n, PAD)
    return 4.0 * part, 4.0 * part, float(opt * part)


def transient(spec, psi: float, unit: float, low: int, hidden: int | None = None
              ) -> tuple[float, float]:
    """v1 like torch FSDP (grad_op keeps units gathered through backward, full two units at a
    time); v2's gathers are scheduled by the compiler: two units assumed, as FULL_SHARD."""
    if spec.shard == "grad_op":
        return psi * low, unit * 4
    return 2 * unit * low, unit * 4


def comm(spec, psi: float, output_share: float = 0.0, root_share: float = 0.0) -> float:
    """Predicted like torch FSDP; the collectives are compiled into the graph and not counted."""
    return 2.0 if spec.shard in ("none", "grad_op") else 3.0
