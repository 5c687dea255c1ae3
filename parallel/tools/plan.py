"""`polyshard plan`: per-rank memory before launch, for each backend x shard level x offload.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, sec. 3-5) with each backend's real
layout: what is kept in which dtype, and how each pads its shards. Activations follow Korthikanti et
al. 2022 ("Reducing Activation Recomputation"), eq. 2: s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit
activations, 2*s*b*h with full recomputation (only each layer's input is kept); doubled in fp32.
The ranking of configs that fit is a heuristic (communication per step: DP/ZeRO-1/2 move 2 Psi,
ZeRO-3/FULL_SHARD 3 Psi, and offload adds PCIe traffic); `polyshard bench` measures the real order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9  # the ZeRO paper's unit
ADAM, SGD = 8, 4  # optimizer state bytes per parameter (fp32 moments / momentum)
STAGE = {"none": 0, "optimizer": 1, "grad_op": 2, "full": 3, "hybrid": 3, "hybrid_grad_op": 3}
# what persists between steps: FSDP's SHARD_GRAD_OP reshards parameters after backward, like
# FULL_SHARD, so both hold stage-3 model states (grad_op only keeps full parameters transiently).
FSDP_STAGE = {"none": 0, "full": 3, "grad_op": 3, "hybrid": 3, "hybrid_grad_op": 3}


@dataclass
class Estimate:
    backend: str
    shard: str
    offload: str
    params: float  # bytes per rank on the device
    grads: float
    optimizer: float
    activations: float | None

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + (self.activations or 0.0)


def zero_paper(psi: float, n: int, k: int = 12) -> dict[str, float]:
    """Mixed-precision Adam as in the ZeRO paper: 2 Psi fp16 weights, 2 Psi fp16 gradients, K Psi
    optimizer state (fp32 master, momentum, variance): bytes per device."""
    return {"DP": (2 + 2 + k) * psi, "ZeRO-1": (2 + 2) * psi + k * psi / n,
            "ZeRO-2": 2 * psi + (2 + k) * psi / n, "ZeRO-3": (2 + 2 + k) * psi / n}


def sharded_numel(shapes: list[tuple[int, ...]], n: int, layout: str) -> int:
    """Elements one rank holds of parameters sharded over n ranks, with the backend's padding:
    fsdp2 pads each parameter's dim 0 to a multiple of n; flat (FSDP1, ZeRO) pads the concatenation
    to a multiple of n; xla pads each flat parameter to a multiple of 128 n."""
    if n == 1:
        return sum(math.prod(s) for s in shapes)
    if layout == "fsdp2":
        return sum(math.ceil(s[0] / n) * math.prod(s[1:]) for s in shapes)
    total = sum(math.prod(s) for s in shapes)
    if layout == "xla":
        return math.ceil(total / (128 * n)) * 128
    return math.ceil(total / n)


def _deepspeed_states(shard, shapes, n, low, opt, fsdp_version):
    psi, stage = sum(math.prod(s) for s in shapes), STAGE[shard]
    if stage == 0 and low == 4:  # fp32 ZeRO-0: the client optimizer on the module's parameters
        return 4.0 * psi, 4.0 * psi, float(opt * psi)
    part = sharded_numel(shapes, n, "flat") if stage else psi
    # low-precision params + fp32 master partition + optimizer partition; DeepSpeed 0.19.8 keeps
    # only the partition's gradients at stage 1 too (measured)
    return low * (part if stage == 3 else psi), low * part, (4 + opt) * part


def _sharded_fp32_states(layout_of):
    """FSDP and XLA FSDP keep fp32 sharded parameters and cast per unit for compute."""
    def states(shard, shapes, n, low, opt, fsdp_version):
        stage = FSDP_STAGE.get(shard, 3)
        part = sharded_numel(shapes, n, layout_of(fsdp_version)) if stage else \
            sum(math.prod(s) for s in shapes)
        return 4.0 * part, 4.0 * part, float(opt * part)
    return states


MODEL_STATES = {
    "fsdp": _sharded_fp32_states(lambda version: "fsdp2" if version == 2 else "flat"),
    "deepspeed": _deepspeed_states,
    "xla_fsdp": _sharded_fp32_states(lambda version: "xla"),
}


def model_states(backend: str, shard: str, offload: str, shapes, n: int, precision: str = "fp32",
                 optimizer: str = "adamw", fsdp_version: int = 2) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per rank on the device."""
    low = 4 if precision == "fp32" else 2
    opt = ADAM if optimizer == "adamw" else SGD
    p, g, o = MODEL_STATES[backend](shard, shapes, n, low, opt, fsdp_version)
    if offload in ("optimizer", "params"):
        o = 0.0
    if offload == "params":
        p, g = 0.0, 0.0
    return p, g, o


def activations(cfg: dict | None, micro_batch: int, seq: int, precision: str,
                checkpointing: bool) -> float | None:
    """Korthikanti et al. per layer, times layers, plus the logits (fp32)."""
    if not cfg:
        return None
    h, a, layers, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"], \
        cfg["vocab_size"]
    s, b = seq, micro_batch
    per_layer = 2 * s * b * h if checkpointing else s * b * h * (34 + 5 * a * s / h)
    scale = 2 if precision == "fp32" else 1
    return scale * per_layer * layers + 4 * s * b * vocab


def candidates(spec_data: dict) -> list[dict]:
    """Every backend x shard x offload the spec language accepts, in ranking order."""
    from parallel.spec.io import SpecError, load_spec

    order = [("none", "none"), ("optimizer", "none"), ("grad_op", "none"), ("full", "none"),
             ("optimizer", "optimizer"), ("grad_op", "optimizer"), ("full", "optimizer"),
             ("full", "params")]
    out = []
    for shard, offload in order:
        for name in MODEL_STATES:
            data = {**spec_data, "backend": name, "shard": shard, "offload": offload}
            try:
                out.append(load_spec(data).model_dump(mode="json"))
            except SpecError:
                continue  # not expressible on that backend (capabilities say why)
    return out


def plan(spec, shapes, cfg: dict | None, world: int, seq: int, optimizer: str = "adamw",
         budget_bytes: float | None = None) -> tuple[list[Estimate], Estimate | None]:
    from parallel.spec.io import load_spec

    rows, best = [], None
    base = spec.model_dump(mode="json", exclude_unset=True)
    nodes = spec.topology.nodes if world % spec.topology.nodes == 0 else 1
    base["topology"] = {**base.get("topology", {}), "nodes": nodes, "procs_per_node": world // nodes}
    for data in candidates(base):
        s = load_spec(data)
        n = s.shard_group_size
        p, g, o = model_states(s.backend, s.shard, s.offload, shapes, n, s.precision, optimizer,
                               s.fsdp.version)
        act = activations(cfg, s.micro_batch_size, seq, s.precision, s.checkpoint_activations)
        est = Estimate(s.backend, s.shard, s.offload, p, g, o, act)
        rows.append(est)
        if best is None and budget_bytes is not None and est.total <= budget_bytes:
            best = est
    return rows, best


def _sharded_comm(shard: str, zero: dict, psi: float) -> float:
    return {0: 2.0, 3: 2.0 if shard == "grad_op" else 3.0}[FSDP_STAGE.get(shard, 3)]


def _deepspeed_comm(shard: str, zero: dict, psi: float) -> float:
    stage = STAGE[shard]
    if stage in (1, 2):
        return 3.0 if zero.get("use_multi_rank_bucket_allreduce", True) else 2.0
    if stage == 3:  # measured 2 Psi even with reuse distance / live parameters 0: see comm_volume
        return 2.0 if psi <= zero.get("stage3_max_live_parameters", 1e9) else 3.0
    return 2.0


COMM = {"fsdp": _sharded_comm, "deepspeed": _deepspeed_comm, "xla_fsdp": _sharded_comm}


def comm_volume(backend: str, shard: str, zero: dict | None = None, psi: float = 0) -> float:
    """Collective volume per step in units of Psi elements: all-gather output + reduce-scatter (or
    reduce) input + 2 x all-reduce (a ring all-reduce is a reduce-scatter and an all-gather).
    ZeRO paper: DP and ZeRO-1/2 2 Psi, ZeRO-3 / FULL_SHARD 3 Psi. DeepSpeed's defaults differ
    (measured, docs/deepspeed.md): ZeRO-1/2 all-reduce gradient buckets unless
    use_multi_rank_bucket_allreduce is false (3 Psi); ZeRO-3 gathered each parameter once per step
    on the measured model (2 Psi), also with stage3_max_reuse_distance, max_live_parameters and
    param_persistence_threshold at 0; models beyond max_live_parameters are predicted at 3 Psi."""
    return COMM[backend](shard, zero or {}, psi)
