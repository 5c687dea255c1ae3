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


def held_layers(spec, n_layers: int, pp_rank: int) -> tuple[int, bool, bool]:
    """(decoder layers, holds the first stage, holds the last) of pipeline rank `pp_rank`, split
    as the engine splits them (the even split, or pipeline.split_points)."""
    from parallel.engine.model.pipeline.schedule import stage_ids
    from parallel.engine.model.pipeline.stages import layer_bounds

    p, pp = spec.pipeline, spec.topology.pp
    n = pp * p.stages_per_rank
    path = p.split_points[0].rpartition(".")[0] if p.split_points else ""  # the layers' container
    bounds = layer_bounds(n_layers, n, p.split_points, path)
    ids = stage_ids(p.schedule, pp_rank, pp, p.stages_per_rank)
    return sum(bounds[s][1] - bounds[s][0] for s in ids), 0 in ids, n - 1 in ids


def p2p_bytes(spec, cfg: dict, seq: int, pp_rank: int) -> float:
    """Bytes pipeline rank `pp_rank` sends per step: each of its stages sends its activation
    forward (but the last) and its input gradient back (but the first), per pipeline
    micro-batch: rows x seq / cp x hidden in the compute dtype, whole on every tp rank."""
    from parallel.engine.model.pipeline.schedule import stage_ids

    p, pp = spec.pipeline, spec.topology.pp
    micro = p.microbatches or spec.micro_batch_size
    n = pp * p.stages_per_rank
    low = 4 if spec.compute == "fp32" else 2
    one = spec.micro_batch_size // micro * -(-seq // spec.topology.cp) * cfg["hidden_size"] * low
    sends = sum((s != n - 1) + (s != 0) for s in stage_ids(p.schedule, pp_rank, pp,
                                                            p.stages_per_rank))
    return sends * micro * spec.grad_accum_steps * one


def tp_logits_bytes(spec, cfg: dict, seq: int, holds_last: bool) -> float:
    """Under topology.pp x tp, the last stage's logits gathered whole over tp (an all-gather of
    rows x seq / cp x vocabulary in the compute dtype per run; at pp 1 plan counts them with the
    head's all-reduces, comm.tp_comm_bytes)."""
    if spec.topology.tp == 1 or not holds_last:
        return 0.0
    low = 4 if spec.compute == "fp32" else 2
    tokens = spec.micro_batch_size * -(-seq // spec.topology.cp)
    return spec.grad_accum_steps * tokens * cfg["vocab_size"] * low


def pipeline_facts(spec, cfg: dict | None, seq: int, psi: float | None = None,
                   whole_activations: float | None = None) -> dict | None:
    """The pipeline's figures for `spec` (None at pp 1); `psi`: the heaviest pipeline rank's
    parameters (per tensor-parallel rank), as plan counts them; `whole_activations`: plan's bytes
    of the whole model's activations for one pipeline micro-batch's rows (pipeline_of), of
    which a stage-chunk holds its share of the layers, times the chunks in flight."""
    pp = spec.topology.pp
    if pp == 1:
        return None
    p = spec.pipeline
    virtual, micro = p.stages_per_rank, p.microbatches or spec.micro_batch_size
    out = {"schedule": p.schedule, "stages": pp * virtual,
           "microbatches": micro * spec.grad_accum_steps,
           "bubble": bubble(p.schedule, pp, virtual, micro),
           "in_flight": in_flight(p.schedule, pp, virtual, micro)}
    if not cfg:
        return out
    layers = cfg["num_hidden_layers"]
    per_chunk = max(held_layers(spec, layers, r)[0] for r in range(pp)) / virtual
    out["p2p_bytes"] = max(p2p_bytes(spec, cfg, seq, r) for r in range(pp))
    if psi is not None:
        out["stage_params"] = psi
    if whole_activations is not None:
        out["activations"] = whole_activations * per_chunk / layers * out["in_flight"]
    return out


def pipeline_of(spec, cfg: dict | None, seq: int, psi: float | None = None) -> dict | None:
    """pipeline_facts with the activations of plan's per-token model (tools/activations.py)."""
    from parallel.tools.activations import activations

    if spec.topology.pp == 1:
        return None
    p = spec.pipeline
    rows = spec.micro_batch_size // (p.microbatches or spec.micro_batch_size)
    whole = activations(cfg, rows, seq, spec.compute, spec.checkpoint_activations,
                        spec.topology.tp, spec.sequence.loss_tile,
                        spec.sequence.offload_activations, spec.topology.cp)
    return pipeline_facts(spec, cfg, seq, psi, whole)


def stage_keep(spec, pp_rank: int | None = None):
    """For plan.model_facts: the parameters pipeline rank `pp_rank`'s stages hold (None: the rank
    holding the most); None at pp 1 (every parameter)."""
    if spec.topology.pp == 1:
        return None

    def keep(model, local: dict) -> set[str]:
        from parallel.engine.model.pipeline.schedule import stage_ids
        from parallel.engine.model.pipeline.stages import held_names

        p, pp = spec.pipeline, spec.topology.pp
        ranks = range(pp) if pp_rank is None else (pp_rank,)
        held = [held_names(model, list(local), stage_ids(p.schedule, r, pp, p.stages_per_rank),
                           pp * p.stages_per_rank, p.split_points) for r in ranks]
        return max(held, key=lambda names: sum(math.prod(local[n]) for n in names))

    return keep
