"""`polyshard plan`: per-rank memory before launch, for each backend x shard level x offload.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, sec. 3-5) with each backend's real
layout: what is kept in which dtype, and how each pads its shards. Activations follow Korthikanti et
al. 2022 ("Reducing Activation Recomputation"), eq. 2: s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit
activations, 2*s*b*h with full recomputation (only each layer's input is kept); doubled in fp32.
The ranking of configs that fit is a heuristic (communication per step: DP/ZeRO-1/2 move 2 Psi,
ZeRO-3/FULL_SHARD 3 Psi, and offload adds PCIe traffic); `polyshard bench` measures the real order.
Each backend's layout and dtypes are its descriptor's plan model (backends/<name>/plan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9  # the ZeRO paper's unit
ADAM, SGD = 8, 4  # optimizer state bytes per parameter (fp32 moments / momentum)


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


# How backends pad the elements one rank holds of parameters sharded over n ranks (their
# descriptors' plan models pick one): each parameter's dim 0 to a multiple of n (FSDP2), the
# concatenation to a multiple of n (flat layouts: FSDP1, ZeRO), or each flat parameter to a multiple
# of `multiple` x n (XLA FSDP: 128).
def numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def per_param_dim0(shapes, n: int) -> int:
    return numel(shapes) if n == 1 else sum(math.ceil(s[0] / n) * math.prod(s[1:]) for s in shapes)


def flat(shapes, n: int) -> int:
    return math.ceil(numel(shapes) / n)


def flat_padded(shapes, n: int, multiple: int) -> int:
    return numel(shapes) if n == 1 else math.ceil(numel(shapes) / (multiple * n)) * multiple


def model_states(spec, shapes, n: int | None = None, optimizer: str = "adamw"
                 ) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per rank on the device, for `spec` over shard groups of n
    (default: the spec's), from its backend's plan model; offload moves what it says off the device."""
    from parallel.registry import get

    low = 4 if spec.precision == "fp32" else 2
    opt = ADAM if optimizer == "adamw" else SGD
    n = n or spec.dims.dp_shard  # ranks one copy of the model is sharded over
    p, g, o = get(spec.backend).plan.model_states(spec, shapes, n, low, opt)
    if spec.offload in ("optimizer", "params"):
        o = 0.0
    if spec.offload == "params":
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
    """Every backend x shard x offload the spec accepts (its backends' own rules included), in
    ranking order."""
    from parallel.registry import names
    from parallel.spec.io import SpecError, load_spec

    order = [("none", "none"), ("optimizer", "none"), ("grad_op", "none"), ("full", "none"),
             ("optimizer", "optimizer"), ("grad_op", "optimizer"), ("full", "optimizer"),
             ("full", "params")]
    out = []
    for shard, offload in order:
        for name in names():
            data = {**spec_data, "backend": name, "shard": shard, "offload": offload}
            try:
                out.append(load_spec(data).model_dump(mode="json"))
            except SpecError:
                continue  # not expressible on that backend (its capabilities and rules say why)
    return out


def plan(spec, shapes, cfg: dict | None, world: int, seq: int, optimizer: str = "adamw",
         budget_bytes: float | None = None) -> tuple[list[Estimate], Estimate | None]:
    from parallel.spec.io import load_spec

    rows, best = [], None
    base = spec.model_dump(mode="json", exclude_unset=True)
    nodes = spec.topology.nodes if world % spec.topology.nodes == 0 else 1
    base["topology"] = {**base.get("topology", {}), "nodes": nodes, "procs_per_node": world // nodes}
    base.pop("global_batch_size", None)  # the plan explores world sizes
    for data in candidates(base):
        s = load_spec(data)
        p, g, o = model_states(s, shapes, optimizer=optimizer)
        act = activations(cfg, s.micro_batch_size, seq, s.precision, s.checkpoint_activations)
        est = Estimate(s.backend, s.shard, s.offload, p, g, o, act)
        rows.append(est)
        if best is None and budget_bytes is not None and est.total <= budget_bytes:
            best = est
    return rows, best


def comm_volume(spec, psi: float = 0, output_share: float = 0.0) -> float:
    """Collective volume per step in units of Psi elements: all-gather output + reduce-scatter (or
    reduce) input + 2 x all-reduce (a ring all-reduce is a reduce-scatter and an all-gather), from
    the spec's backend. ZeRO paper: DP and ZeRO-1/2 2 Psi, ZeRO-3 / FULL_SHARD 3 Psi; DeepSpeed's
    defaults differ (docs/deepspeed.md). `output_share`: the fraction of Psi in the final norm and
    output layer, which a backend may keep gathered from forward into backward (Llama-3-8B: 0.065,
    a 2-layer toy: 0.235)."""
    from parallel.registry import get

    return get(spec.backend).plan.comm(spec, psi, output_share)
