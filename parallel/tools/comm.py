"""`polyshard plan`'s communication: each backend's collective volume per step (its plan model),
split into what one rank's collectives carry by type and dtype (`planned_collectives`: what `polyshard
dryrun` prints beside the bytes it counts), the seconds those take over ring algorithms at the
stated links, tensor parallelism's all-reduces, and offload's PCIe copies."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace


@dataclass(frozen=True)
class Links:
    """Bandwidths in GB/s (1e9 bytes) one rank sees: the defaults are an 8-GPU NVLink node (NCCL
    bus bandwidth), 400 Gb/s of network per GPU, and PCIe Gen4 x16."""

    intra: float = 300.0
    inter: float = 50.0
    pcie: float = 25.0
    disk: float = 1.0  # what one rank writes a checkpoint at (a shared file system's share)


def comm_seconds(spec, psi: float, links: Links, output_share: float = 0.0,
                 root_share: float = 0.0, float8: float = 0.0) -> float:
    """The step's collectives (planned_collectives) as ring collectives: each rank moves (n-1)/n of
    an all-gather's or reduce-scatter's bytes and twice that of an all-reduce's, over the slowest
    link the group spans; a hybrid's replica all-reduce across nodes."""
    n, per_node = spec.shard_group_size, spec.topology.procs_per_node
    link = (links.intra if n <= per_node else links.inter) * 1e9
    planned = planned_collectives(spec, psi, output_share, root_share, float8=float8)
    seconds = 0.0
    if n > 1:
        seconds += (planned.get("all_gather", 0.0) + planned.get("reduce_scatter", 0.0)
                    + 2 * planned.get("all_reduce_group", 0.0)) * (n - 1) / n / link
    replicas = spec.dims.dp_size // n
    if replicas > 1:
        seconds += 2 * planned["all_reduce_replicas"] * (replicas - 1) / replicas / (
            links.inter * 1e9)
    return seconds


def planned_collectives(spec, psi: float, output_share: float = 0.0, root_share: float = 0.0,
                        last_root: float = 0.0, float8: float = 0.0) -> dict[str, float]:
    """Bytes one rank's data-parallel collectives carry per step, as `polyshard dryrun` counts them
    (all-gather: its output; reduce-scatter: its input; all-reduce: its tensor): the gradients are
    reduced once in the reduce dtype (unsharded: all-reduced, `all_reduce_group`; sharded:
    reduce-scattered, and each shard all-reduced across hybrid replicas, `all_reduce_replicas`),
    and whatever else the backend's volume (comm_volume) moves is parameters gathered in the
    compute dtype. Before #42 every byte was sized in the reduce dtype: FULL_SHARD in bf16 with fp32
    reduction came out 50% high (Llama-3-8B, 1024 ranks, tp 8: 17.4 GB against 11.6 counted).
    `float8`: the parameters float8.all_gather gathers in 1 byte (float8_gathered), each time
    their blocks are gathered."""
    low = 4 if spec.compute == "fp32" else 2
    red = 4 if spec.grad_reduce_dtype == "fp32" else 2
    n = spec.shard_group_size
    if n <= 1:
        return {}
    volume = comm_volume(spec, psi, output_share, root_share)
    if spec.shard == "none":
        return {"all_reduce_group": psi * red, "all_gather": max(0.0, volume - 2.0) * psi * low}
    out = {"all_gather": max(0.0, volume - 1.0) * psi * low, "reduce_scatter": psi * red}
    k, defers = spec.grad_accum_steps, pipeline_defers()
    if spec.topology.pp > 1 and not defers:  # torch < 2.15: each run of the schedule reduces
        out["reduce_scatter"] *= k
    passes = max(0.0, comm_volume(spec, 1.0) - 1.0)  # the blocks' gathers (float8, below)
    if spec.topology.pp > 1 and spec.shard == "full":
        # torch's schedules keep a stage gathered from its first backward to its last in each
        # run (set_reshard_after_backward), and each micro-batch's forward gathers it again:
        # m + 1 gathers of the rank's stages per run (dry run, FSDP2: 5 at m 4, 9 at m 8), but
        # once for the last stage's root unit (`last_root` parameters: norm and head), whose
        # backward follows each forward at once. Runs that defer their reduction (torch 2.15's
        # finalize_gradients, schedule.py) keep the stage gathered into the next run: k x m + 1
        # gathers a step, the root's once (dry run: 5 and 7 at m 2, k 2 and 3)
        m = spec.pipeline.microbatches or spec.micro_batch_size
        passes = k * m + 1 if defers else k * (m + 1)
        root = 1 if defers else k
        out["all_gather"] = (passes * (psi - last_root) + root * last_root) * low
    if float8:  # the blocks' converted weights, gathered as often as the blocks are
        out["all_gather"] -= passes * float8 * (low - 1)
    if spec.dims.dp_size // n > 1:
        out["all_reduce_replicas"] = psi / n * red
    return out


def pipeline_defers() -> bool:
    """torch's schedules leave an FSDP stage's gradients unreduced until the step's last run
    (parallel/engine/model/pipeline/schedule.py: torch 2.15's finalize_gradients)."""
    from parallel.engine.model.pipeline.schedule import DEFERS

    return DEFERS


def float8_gathered(spec, shapes, cfg: dict | None) -> float:
    """Parameters of `shapes` that precision: fp8 gathers in float8 (float8.all_gather): the
    default filter's rule (engine/model/float8.py) on shapes alone: matrices without the
    vocabulary (embedding, head) or the expert count (routers), both sides multiples of 16."""
    if spec.precision != "fp8" or not spec.float8.all_gather:
        return 0.0
    cfg = cfg or {}
    skip = {cfg.get(k) for k in ("vocab_size", "num_local_experts", "num_experts")} - {None}
    return float(sum(a * b for a, b in (s for s in shapes if len(s) == 2)
                     if not {a, b} & skip and a % 16 == 0 and b % 16 == 0))


def offload_seconds(spec, psi: float, links: Links) -> float:
    """PCIe copies per step and rank: gradients down (fp32) and updated parameters up; with params
    offload, the parameters up again for forward and backward."""
    if spec.offload == "none":
        return 0.0
    low, part = (4 if spec.compute == "fp32" else 2), psi / spec.shard_group_size
    copies = (4 + low) * part + (2 * low * part if spec.offload == "params" else 0.0)
    return copies / (links.pcie * 1e9)


def tp_comm_bytes(cfg: dict | None, spec, seq: int, rowwise: int = 2, colwise: int = 5,
                  pp_rank: int | None = None) -> float:
    """Bytes one rank all-reduces per step for tensor parallelism without sequence parallelism, as
    torch's DTensor runs it (counted by `polyshard dryrun`): per layer and micro-batch, s x b x h in
    the compute dtype for each rowwise output in forward (all but the last again in activation
    checkpointing's recomputation) and each colwise module's input gradient in backward (Hugging
    Face's Llama-style
    plan: 2 rowwise, o/down; 5 colwise, q/k/v/gate/up: one all-reduce each, where Megatron fuses
    q/k/v and gate/up into 2); plus the head's logits gathered whole once forward and its input
    gradient all-reduced. With topology.cp each rank's tensors hold seq / cp tokens. With
    topology.pp, pipeline rank `pp_rank`'s layers (None: the busiest rank's), the head's part on the
    rank holding the last stage."""
    tp = spec.topology.tp
    if tp == 1 or not cfg:
        return 0.0
    low = 4 if spec.compute == "fp32" else 2
    s, b, h = -(-seq // spec.topology.cp), spec.micro_batch_size, cfg["hidden_size"]
    # activation checkpointing's recomputation stops at the last saved tensor backward needs, so
    # the block's last rowwise all-reduce is not run again (measured: 9 -> 8 per layer, not 10)
    again = rowwise - 1 if spec.checkpoint_activations else 0
    per_layer = (rowwise + again + colwise) * s * b * h * low
    head = 4 * s * b * cfg["vocab_size"] + s * b * h * low
    layers = cfg["num_hidden_layers"]
    if spec.topology.pp == 1:
        return spec.grad_accum_steps * (layers * per_layer + head)
    from parallel.tools.stages import held_layers

    head = s * b * h * low  # the logits' gather is an all-gather there (stages.tp_logits_bytes)
    ranks = range(spec.topology.pp) if pp_rank is None else (pp_rank,)
    return spec.grad_accum_steps * max(n * per_layer + head * last for n, _, last in
                                       (held_layers(spec, layers, r) for r in ranks))


def cp_comm_bytes(cfg: dict | None, spec, seq: int) -> float:
    """Bytes one rank hands to all-to-alls per step for topology.cp (Ulysses: parallel/engine/
    model/context_parallel.py), as the dry run counts them (each call's input: the rank's whole
    local tensor, of which it keeps 1/cp): per layer and micro-batch, forward exchanges q, k, v
    and the attention's output; backward the same four gradients; activation checkpointing's
    recomputation the forward's again (o_proj's saved input is the output's exchange). Local
    tensors hold seq / cp tokens (rounded up: rows are padded to a multiple of cp) and the rank's
    heads after tp, key/value heads repeated where cp does not divide them (kv_repeat)."""
    from parallel.engine.model.context_parallel import kv_repeat

    cp, tp = spec.topology.cp, spec.topology.tp
    if cp == 1 or not cfg:
        return 0.0

    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    # kv_repeat reads a transformers config's attributes
    repeat, _ = kv_repeat(SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads),
                          tp, cp)
    low = 4 if spec.compute == "fp32" else 2
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    tokens = spec.micro_batch_size * -(-seq // cp)
    q = tokens * heads // tp * head_dim * low
    kv = tokens * kv_heads // tp * repeat * head_dim * low
    passes = 3 if spec.checkpoint_activations else 2
    return spec.grad_accum_steps * cfg["num_hidden_layers"] * passes * (2 * q + 2 * kv)


def comm_volume(spec, psi: float = 0, output_share: float = 0.0, root_share: float = 0.0) -> float:
    """Collective volume per step in units of Psi elements: all-gather output + reduce-scatter (or
    reduce) input + 2 x all-reduce (a ring all-reduce is a reduce-scatter and an all-gather), from
    the spec's backend. ZeRO paper: DP and ZeRO-1/2 2 Psi, ZeRO-3 / FULL_SHARD 3 Psi; DeepSpeed's
    defaults differ (docs/deepspeed.md). `output_share`: the fraction of Psi in the final norm and
    output layer, which a backend may keep gathered from forward into backward (Llama-3-8B: 0.065,
    a 2-layer toy: 0.235)."""
    from parallel.registry import get

    return get(spec.backend).plan.comm(spec, psi, output_share, root_share=root_share)


def muon_exchange_bytes(spec, hidden: float) -> float:
    """Bytes a rank sends per step for torch.optim.Muon on sharded matrices (optim/muon.py): its
    pieces of the `hidden` Muon parameters to their owners, and as owner the others' pieces of its
    matrices back, bf16 both ways; (n - 1) / n of each leaves the rank. Ranks that hold whole
    matrices (shard none) send nothing."""
    n = spec.dims.dp_shard * spec.dims.cp * spec.dims.tp if spec.shard != "none" else 1
    return 2 * 2 * hidden / n * (n - 1) / n
