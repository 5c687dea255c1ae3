"""`polyshard plan`: per-rank memory before launch, for each backend x shard level x offload.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, sec. 3-5) with each backend's real
layout: what is kept in which dtype, and how each pads its shards. Activations follow Korthikanti et
al. 2022 ("Reducing Activation Recomputation"), eq. 2: s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit
activations, 2*s*b*h with full recomputation (only each layer's input is kept); doubled in fp32.
Peak device memory per rank = model states + what is held transiently (gathered units and
communication buckets: each backend's plan model) + activations (with full recomputation, one
layer's whole activations during its backward too) + a stated margin (CUDA context and allocator
fragmentation, `Margin`). Host memory per node: what offload moves there, for every rank of the node.
Communication time per step: each backend's collective volume over ring algorithms at the stated
link bandwidths (`Links`: the shard group's collectives intra-node when it fits in a node, else
inter-node; a hybrid's replica all-reduce inter-node), plus offload's PCIe copies, not overlapped
(an upper bound): "fastest" is the least of these seconds among the configs that fit; `polyshard
bench` measures the real order. Each backend's layout and dtypes: backends/<name>/plan.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.tools.comm import (  # noqa: F401 (plan's communication, re-exported)
    Links,
    comm_seconds,
    comm_volume,
    cp_comm_bytes,
    float8_gathered,
    muon_exchange_bytes,
    offload_seconds,
    planned_collectives,
    tp_comm_bytes,
)
from parallel.kits.sizes import numel
from parallel.tools.activations import activations  # noqa: F401 (plan's activation model)
from parallel.tools.experts import all_to_all_bytes, extra_gather_bytes, shard_groups

GB = 1e9  # the ZeRO paper's unit
ADAM, SGD = 8, 4  # optimizer state bytes per parameter (fp32 moments / momentum)


@dataclass(frozen=True)
class Margin:
    """What the framework and allocator take beyond tensors: the CUDA context (torch 2.x with
    cuBLAS/NCCL loaded: about 0.5 GiB) and the caching allocator's fragmentation, as a fraction of
    the rest."""

    context_gib: float = 0.5
    fragmentation: float = 0.10


@dataclass
class Estimate:
    backend: str
    shard: str
    offload: str
    params: float  # bytes per rank on the device, between steps
    grads: float
    optimizer: float
    activations: float | None
    gathered: float = 0.0  # parameters held gathered at the peak, beyond the rank's shard
    buffers: float = 0.0  # communication buckets and unsharded gradients in flight
    margin: float = 0.0  # CUDA context + fragmentation
    host_per_node: float = 0.0  # what offload keeps in host memory, every rank of a node
    comm_s: float = 0.0  # collectives per step at the stated link bandwidths
    offload_s: float = 0.0  # PCIe copies per step
    ckpt_bytes: float = 0.0  # what the rank writes of a checkpoint (the most any rank writes)
    ckpt_s: float = 0.0  # its save at the stated disk bandwidth

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """The peak per rank: what has to fit on the device."""
        return self.state + self.gathered + self.buffers + (self.activations or 0.0) + self.margin

    @property
    def step_comm_s(self) -> float:
        return self.comm_s + self.offload_s


def zero_paper(psi: float, n: int, k: int = 12) -> dict[str, float]:
    """The ZeRO paper's mixed-precision Adam bytes per device (2 + 2 + K Psi, partitioned)."""
    return {"DP": (2 + 2 + k) * psi, "ZeRO-1": (2 + 2) * psi + k * psi / n,
            "ZeRO-2": 2 * psi + (2 + k) * psi / n, "ZeRO-3": (2 + 2 + k) * psi / n}



def model_states(spec, shapes, n: int | None = None, optimizer: str | float = "adamw",
                 host: bool = False) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per rank on the device, for `spec` over shard groups of n
    (default: the spec's), from its backend's plan model; offload moves what it says off the device
    (`host`: those bytes instead, what the host holds for this rank). `optimizer`: its name, or
    its state bytes per parameter (optimizer_bytes)."""
    from parallel.registry import get

    low = 4 if spec.compute == "fp32" else 2
    opt = optimizer_bytes(shapes, optimizer) if isinstance(optimizer, str) else optimizer
    # ranks one copy of the model is sharded over: with cp, dp_shard x cp (shard_group_size)
    n = n or spec.dims.dp_shard * spec.dims.cp
    states = get(spec.backend).plan.model_states(spec, shapes, n, low, opt)
    moved = (False, False, spec.offload != "none") if spec.offload != "params" else (True,) * 3
    return tuple(x if m == host else 0.0 for x, m in zip(states, moved))


def optimizer_bytes(shapes, optimizer: str, vocab: int | None = None) -> float:
    """Optimizer state bytes per parameter of `shapes`: AdamW's two fp32 moments, SGD's momentum;
    "muon" (recipes.muon_with_adamw): Muon's one momentum on the hidden matrices, AdamW's moments
    on the rest."""
    if optimizer != "muon":
        return ADAM if optimizer == "adamw" else SGD
    total = float(numel(shapes)) or 1.0
    hidden = muon_numel(shapes, vocab)
    return (SGD * hidden + ADAM * (total - hidden)) / total


def muon_numel(shapes, vocab: int | None) -> float:
    """Parameters the Muon recipe gives Muon: recipes.hidden_matrices' rule on shapes alone (in
    the model's order), the 2-D ones but the token embedding and the head: the first and the last
    matrix with a dimension of `vocab` (a hidden matrix may have one too: the demo's 256)."""
    matrices = [i for i, s in enumerate(shapes) if len(s) == 2]
    ends = [i for i in matrices if vocab in shapes[i]]
    skip = {ends[0], ends[-1]} if ends else set()
    return float(numel([shapes[i] for i in matrices if i not in skip]))


def states_of(spec, shapes, cfg: dict | None, optimizer: str = "adamw",
              host: bool = False) -> tuple[float, float, float]:
    """model_states over each group of the rank's parameters and the ranks it is sharded over
    (topology.ep's experts apart: tools/experts.py)."""
    vocab = (cfg or {}).get("vocab_size")
    parts = [model_states(spec, group, n, optimizer_bytes(group, optimizer, vocab), host)
             for group, n in shard_groups(spec, shapes, cfg)]
    return tuple(sum(values) for values in zip(*parts))


def checkpoint_bytes(spec, shapes, cfg: dict | None, optimizer: str = "adamw") -> float:
    """What the rank that writes most writes of one checkpoint: the fp32 weights and the optimizer
    state (the portable format's model and optim sections) of the whole model (`cfg`'s `_params`;
    a bare count: one tp x pp rank's `shapes` times tp x pp). With state_dict: sharded each rank
    writes 1/N (its shards; DCP writes a tensor held whole by several ranks once, spreading such
    tensors over the ranks by size); with full, rank 0 writes it all."""
    t = spec.topology
    whole = float((cfg or {}).get("_params") or numel(shapes) * t.tp * t.pp)
    total = whole * (4 + optimizer_bytes(shapes, optimizer, (cfg or {}).get("vocab_size")))
    return total if spec.state_dict == "full" else total / spec.world_size


def transient(spec, psi: float, unit: float, hidden: int | None = None) -> tuple[float, float]:
    """(gathered, buffers) bytes at the peak, from the backend's plan model (FULL_SHARD's rule
    where it has none)."""
    from parallel.registry import get

    low = 4 if spec.compute == "fp32" else 2
    rule = get(spec.backend).plan.transient
    if rule is None:
        return (0.0 if spec.shard == "none" else 2 * unit * low), unit * 4
    return rule(spec, psi, unit, low, hidden)


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
         budget_bytes: float | None = None, unit: float | None = None, links: Links = Links(),
         margin: Margin = Margin(), per_node: int | None = None
         ) -> tuple[list[Estimate], Estimate | None]:
    """Every candidate's estimate, and the one with the least communication time among those
    whose peak fits `budget_bytes`. `unit`: the largest shard unit's parameters (default: the
    whole model, when nothing tells); `per_node`: devices per node (default: the spec's nodes)."""
    from parallel.spec.io import load_spec

    rows = []
    psi = float(numel(shapes))
    base = spec.model_dump(mode="json", exclude_unset=True)
    nodes = spec.topology.nodes if world % spec.topology.nodes == 0 else 1
    if per_node and world % per_node == 0:
        nodes = world // per_node
    base["topology"] = {**base.get("topology", {}), "nodes": nodes, "procs_per_node": world // nodes}
    base.pop("global_batch_size", None)  # the plan explores world sizes
    for data in candidates(base):
        s = load_spec(data)
        est = predict(s, shapes, cfg, seq, optimizer, unit)
        tensors = est.total
        est.margin = margin.context_gib * 2 ** 30 + margin.fragmentation * tensors
        est.host_per_node = sum(states_of(s, shapes, cfg, optimizer, host=True)) * \
            s.topology.procs_per_node
        moe = (cfg or {}).get("_moe") if s.topology.ep > 1 else None
        gathered = moe["gathered"] if moe else psi  # ep: each rank gathers its own experts
        est.comm_s = comm_seconds(s, gathered, links, float8=float8_gathered(s, shapes, cfg))
        est.offload_s = offload_seconds(s, psi, links)
        est.ckpt_bytes = checkpoint_bytes(s, shapes, cfg, optimizer)
        est.ckpt_s = est.ckpt_bytes / (links.disk * 1e9)
        ep = s.topology.ep  # an all-to-all moves (ep - 1) / ep of its input; ep sits inside hosts
        est.comm_s += (ep - 1) / ep * all_to_all_bytes(moe, s, seq) / (
            (links.intra if ep <= s.topology.procs_per_node else links.inter) * 1e9)
        est.comm_s += extra_gather_bytes(moe, s) / (links.inter * 1e9)  # over dp_shard / ep
        tp = s.topology.tp  # a ring all-reduce moves 2 (tp - 1) / tp of the bytes, inside a host
        est.comm_s += 2 * (tp - 1) / tp * tp_comm_bytes(cfg, s, seq) / (links.intra * 1e9)
        if optimizer == "muon":  # each matrix to its owner and back, over its shard group
            group = s.dims.dp_shard * s.dims.cp * s.dims.tp
            hidden = muon_numel(shapes, (cfg or {}).get("vocab_size"))
            est.comm_s += muon_exchange_bytes(s, hidden) / (
                (links.intra if group <= s.topology.procs_per_node else links.inter) * 1e9)
        cp = s.topology.cp  # an all-to-all moves (cp - 1) / cp of its input; cp sits inside hosts
        inside = tp * cp <= s.topology.procs_per_node  # when tp x cp fits one
        est.comm_s += (cp - 1) / cp * cp_comm_bytes(cfg, s, seq) / (
            (links.intra if inside else links.inter) * 1e9)
        rows.append(est)
    fits = [r for r in rows if budget_bytes is not None and r.total <= budget_bytes]
    best = min(fits, key=lambda r: r.step_comm_s, default=None)
    return rows, best


def longest_seq(spec, shapes, cfg: dict | None, budget_bytes: float, optimizer: str = "adamw",
                unit: float | None = None, margin: Margin = Margin(), limit: int = 1 << 22) -> int:
    """The longest sequence (tokens per row, a multiple of cp) whose predicted peak per rank,
    margin included, fits `budget_bytes` for this spec as written; 0 if none does (the model
    states alone are over). Activations grow with the length; a binary search over predict()."""
    step = spec.topology.cp

    def fits(seq: int) -> bool:
        est = predict(spec, shapes, cfg, seq, optimizer, unit)
        return est.total + margin.context_gib * 2 ** 30 + margin.fragmentation * est.total \
            <= budget_bytes

    low, high = 0, limit // step  # in units of cp tokens
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid * step) else (low, mid - 1)
    return low * step


def predict(spec, shapes, cfg: dict | None, seq: int, optimizer: str = "adamw",
            unit: float | None = None) -> Estimate:
    """One spec's tensors at the peak per rank, without the margin (what `polyshard bench`
    compares with the bytes it measures); `unit` as in plan()."""
    psi = float(numel(shapes))
    est = Estimate(spec.backend, spec.shard, spec.offload,
                   *states_of(spec, shapes, cfg, optimizer),
                   activations(cfg, spec.micro_batch_size, seq, spec.compute,
                               spec.checkpoint_activations, spec.topology.tp,
                               spec.sequence.loss_tile, spec.sequence.offload_activations,
                               spec.topology.cp))
    if spec.topology.pp > 1 and cfg:  # a pipeline rank holds its stage-chunks in flight
        from parallel.tools.stages import pipeline_of

        est.activations = pipeline_of(spec, cfg, seq).get("activations")
    moe = (cfg or {}).get("_moe") if spec.topology.ep > 1 else None
    held = moe["gathered"] if moe else psi  # ep: a rank gathers its own experts only
    est.gathered, est.buffers = transient(spec, held, unit or held, (cfg or {}).get("hidden_size"))
    return est
