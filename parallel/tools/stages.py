"""What `polyshard plan` counts for topology.pp: each schedule's bubble, the activations in flight on
the busiest stage, the point-to-point bytes a rank sends per step, and the heaviest stage's share of
the parameters. Counted, not measured: unit-time forwards and backwards (a backward twice a forward
does not change the bubble's share in these schedules), the busiest rank being the first (it holds
the most micro-batches in flight and, with untied embeddings, about as much as the last).

- gpipe: every forward, then every backward: the bubble is (p - 1) / (m + p - 1) of the step and each
  stage holds all m micro-batches' activations at the turn.
- 1f1b: the same bubble; the first stage holds min(m, p) micro-batches (Narayanan et al. 2021).
- interleaved_1f1b, v stages per rank: the bubble shrinks to (p - 1) / (v m + p - 1); the first rank
  holds (v - 1) p + 2 (p - 1) + 1 stage-chunks in flight in torch's order (its warm-up), at most v m.
Each stage boundary carries one activation forward and its gradient back per micro-batch: rows x
seq / cp x hidden in the compute dtype, whole on every tensor-parallel rank.
"""

from __future__ import annotations

import math


def bubble(schedule: str, pp: int, virtual: int, micro: int) -> float:
    """The idle share of a step on each rank."""
    chunks = virtual * micro if schedule == "interleaved_1f1b" else micro
    return (pp - 1) / (chunks + pp - 1)


def in_flight(schedule: str, pp: int, virtual: int, micro: int) -> int:
    """Stage-chunks whose activations the first rank holds at its peak."""
    if schedule == "gpipe":
        return micro * virtual
    if schedule == "interleaved_1f1b":
        return min(virtual * micro, (virtual - 1) * pp + 2 * (pp - 1) + 1)
    return min(micro, pp)


def pipeline_facts(spec, cfg: dict | None, seq: int, psi: float,
                   whole_activations: float | None) -> dict | None:
    """The pipeline's figures for `spec` (None at pp 1). `whole_activations`: plan's activation
    bytes of the whole model for one pipeline micro-batch's rows; `psi`: parameters per tensor-
    parallel rank."""
    pp = spec.topology.pp
    if pp == 1:
        return None
    p = spec.pipeline
    virtual, micro = p.stages_per_rank, p.microbatches or spec.micro_batch_size
    rows = spec.micro_batch_size // micro
    stages = pp * virtual
    out = {"schedule": p.schedule, "stages": stages, "microbatches": micro * spec.grad_accum_steps,
           "bubble": bubble(p.schedule, pp, virtual, micro),
           "in_flight": in_flight(p.schedule, pp, virtual, micro)}
    if not cfg:
        return out
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    per_chunk = math.ceil(layers / stages)  # the first stages take the extra layers
    low = 4 if spec.precision == "fp32" else 2
    send = rows * -(-seq // spec.topology.cp) * hidden * low
    # every stage-chunk sends its activation forward and its input gradient back per micro-batch
    # (the first stage no gradient, the last no activation: a middle rank's count)
    out["p2p_bytes"] = 2 * virtual * micro * spec.grad_accum_steps * send
    embed = cfg["vocab_size"] * hidden
    blocks = max(0.0, psi - 2 * embed)
    out["stage_params"] = blocks * per_chunk * virtual / layers + embed
    if whole_activations is not None:
        out["activations"] = whole_activations * per_chunk / layers * out["in_flight"]
    return out
