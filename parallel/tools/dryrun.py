"""`polyshard dryrun`: one rank of a world of N, built for real in this process, beside `plan`.

torch's fake process group (backend "fake", torch.testing's fake_pg) answers every collective at
once and moves no data, so one process can be rank r of a world of 1024: the engine builds its
real mesh, tensor-parallel split and FSDP shards of the model (constructed on the meta device, then
given memory for its shards only), runs real steps, and what the rank holds is measured as `bench`
measures it (parallel/tools/bench/measure.py): its parameter, gradient and optimizer bytes, the
peak of its tensors during a step, and its collectives per step (calls and bytes by type). The
values are garbage (every gather returns what was in memory), so losses mean nothing; memory,
shapes and collectives are those of the real job. The backend says what it needs changed to run
this way (its descriptor's `bench.dryrun`: nothing broadcast from rank 0, which the fake group
cannot carry) and the report says so.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from parallel.tools.comm import float8_gathered

SEED_STD = 0.02  # weights drawn like transformers' initializer_range: finite activations


@dataclass
class DryRun:
    world: int
    rank: int
    tp: int
    measured: dict  # params, grads, optimizer, peak: bytes on this rank
    planned: dict  # the same from `plan`
    collectives: dict  # {type: {"calls": n, "bytes": b, "planned": plan's bytes}} in one step
    changed: dict  # the spec overrides the backend needed
    cp: int = 1

    def rows(self) -> list[tuple[str, int, float, float | None]]:
        out = []
        for key in ("params", "grads", "optimizer", "peak"):
            got, want = self.measured.get(key), self.planned.get(key)
            err = (want - got) / got if got and want is not None else None
            out.append((key, got, want, err))
        return out


def world_spec(spec, world: int):
    """The spec laid out over `world` ranks (parallel/spec/io.py's over_world)."""
    from parallel.spec.io import load_spec

    return load_spec(spec, world=world)


def dryrun_spec(spec, world: int):
    """world_spec plus the backend's dry-run overrides; SpecError when it has none."""
    from parallel.registry import get
    from parallel.spec.io import SpecError, load_spec
    from parallel.tools.cells import merged

    overrides = get(spec.backend).bench.dryrun
    if overrides is None:
        raise SpecError([("backend", f"{spec.backend!r} cannot run over a fake process group "
                          "(its collectives are compiled or its set-up needs real peers); "
                          "`polyshard plan` predicts it")])
    laid = world_spec(spec, world)
    return load_spec(merged(laid.model_dump(mode="json", exclude_unset=True), overrides)), overrides


# c10d ops whose output the fake group leaves as allocated (uninitialised memory: NaN, whose loss
# the engine would rightly refuse), and the argument holding it; functional ones return theirs
GATHERS = {"_allgather_base_": 0, "allgather_": 0, "allgather_into_tensor_coalesced_": 0,
           "_reduce_scatter_base_": 0, "reduce_scatter_": 0, "reduce_scatter_tensor_coalesced_": 0,
           "alltoall_base_": 0, "recv_": 0}
FUNCTIONAL = ("all_gather_into_tensor", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
              "reduce_scatter_tensor_coalesced", "all_to_all_single")


def finite_collectives():
    """A dispatch mode that zeros what a fake collective hands back: gathered weights of 0 give
    finite losses and gradients, so the step runs whole (optimizer state included). One memset per
    collective; the allocations are the real job's. DTensor's collectives are seen too
    (counting.OpWatch steps aside for tensor subclasses, as for counting)."""
    from parallel.tools.bench.counting import OpWatch

    def zero_output(name: str, args, out) -> None:
        space, _, op = name.partition("::")
        if space == "c10d" and op == "alltoall_base_" and args[0].shape == args[1].shape \
                and not args[0].is_floating_point():
            # topology.ep's exchange of row counts: each rank is handed its own, as if its peers
            # routed alike, so it receives as many rows as it sends (zeros: none at all)
            args[0].copy_(args[1])
        elif space == "c10d" and op in GATHERS:
            _zero(args[GATHERS[op]])
        elif space == "_c10d_functional" and op in FUNCTIONAL:
            _zero(out)

    return OpWatch(after=zero_output)


def _zero(obj) -> None:
    if isinstance(obj, torch.Tensor):
        obj.zero_()
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _zero(item)


def join_fake_world(rank: int, world: int, per_node: int) -> None:
    """This process becomes rank `rank` of `world` over the fake group; the engine then reads the
    launcher's variables as torchrun would have set them. The fake backend is registered by
    importing torch's testing module (torch.testing._internal: private, pinned with torch)."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers backend "fake")

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node))
    os.environ.pop("MASTER_ADDR", None)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)


def materialise(model: torch.nn.Module, device) -> None:
    """Memory for the rank's shards only (the model was built on the meta device), filled with
    finite values: weights ~ N(0, 0.02), floating buffers in [0, 1) (rotary frequencies)."""
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).normal_(0.0, SEED_STD)
        for b in model.buffers():
            if b.is_floating_point():
                b.uniform_(0.0, 1.0)


def by_type(planned: dict[str, float], tp_bytes: float) -> dict[str, float]:
    """plan's bytes under the collective types a counter sees (its all-reduces are one type)."""
    out = {k: v for k, v in planned.items() if not k.startswith("all_reduce")}
    reduced = sum(v for k, v in planned.items() if k.startswith("all_reduce")) + tp_bytes
    if reduced:
        out["all_reduce"] = reduced
    return out


def predicted_collectives(spec, cfg: dict, seq: int, psi: float, shares: tuple,
                          pp_rank: int, float8: float = 0.0) -> dict[str, float]:
    """plan's bytes per collective type for this rank (`psi`: its parameters; `shares`:
    kept_shares'): the data-parallel ones, TP's, and with topology.pp the sends between stages and
    the last stage's logits gathered over tp; with topology.cp Ulysses' exchanges."""
    from parallel.tools.comm import cp_comm_bytes, planned_collectives, tp_comm_bytes
    from parallel.tools.experts import all_to_all_bytes, extra_gather_bytes
    from parallel.tools.stages import held_layers, p2p_bytes, tp_logits_bytes

    output, root, whole = shares
    moe = cfg.get("_moe") if spec.topology.ep > 1 else None
    psi = moe["gathered"] if moe else psi  # ep: the rank gathers its own experts only
    last = spec.topology.pp > 1 and held_layers(spec, cfg["num_hidden_layers"], pp_rank)[2]
    predicted = by_type(planned_collectives(spec, psi, output, root, output * whole if last
                                            else 0.0, float8),
                        tp_comm_bytes(cfg, spec, seq, pp_rank=pp_rank))
    if spec.topology.pp > 1:  # activations and their gradients between stages
        predicted["send"] = p2p_bytes(spec, cfg, seq, pp_rank)
        predicted["all_gather"] = predicted.get("all_gather", 0.0) + \
            tp_logits_bytes(spec, cfg, seq, last)
    if spec.topology.cp > 1:  # Ulysses' exchanges (plan: cp_comm_bytes)
        predicted["all_to_all"] = cp_comm_bytes(cfg, spec, seq)
    if moe:  # the experts' dispatch, and their gathers in recomputation (tools/experts.py)
        predicted["all_to_all"] = predicted.get("all_to_all", 0.0) + all_to_all_bytes(moe, spec, seq)
        predicted["all_gather"] = predicted.get("all_gather", 0.0) + extra_gather_bytes(moe, spec)
    return predicted


def kept_shares(model, wrap, tp: int = 1, tp_plan: dict | None = None
                ) -> tuple[float, float, float]:
    """(output, root, parameters): the fractions of one tensor-parallel rank's parameters in the output layer
    with the final norm before it (Hugging Face names: model.norm, transformer.ln_f), and in what
    no wrap unit holds (embeddings, final norm, head): what a backend may keep gathered from
    forward into backward (its plan model's `comm`). Weighed by the rank's TP shards (`model`
    unprepared, on the meta device): the 8B at tp 8 splits its head 8 ways and not its
    embedding, so the whole model's head share (0.065; 0.35 at 2 layers) is not the rank's
    (0.045; 0.10), and plan's gathers came out 13% low at 2 layers. `parameters`: the rank's
    whole (the shares' denominator)."""
    from parallel.engine.model.tp_plan import local_shapes
    from parallel.engine.model.wrap import plan_wrap

    size = {id(p): math.prod(shape) for (_, shape, _), p in
            zip(local_shapes(model, tp, tp_plan), model.parameters())}
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    norm = next((getattr(base, n) for n in ("norm", "ln_f", "final_layer_norm")
                 if isinstance(getattr(base, n, None), torch.nn.Module)), None)
    total = sum(size.values()) or 1
    kept = {id(p) for m in (out, norm) if m is not None for p in m.parameters()}
    inside = {id(p) for _, unit in plan_wrap(model, wrap) if unit is not model
              for p in unit.parameters()}
    root = sum(n for i, n in size.items() if i not in inside)
    return sum(size[i] for i in kept) / total, root / total, float(total)


def activation_of(config, precision: str):
    """A stage's input after the first: the hidden states of its pipeline micro-batch, in the
    compute dtype (what torch's shape inference would receive from the previous stage)."""
    dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(precision, torch.bfloat16)
    hidden = config.get_text_config().hidden_size

    def given(stage: int, chunk: tuple) -> tuple:
        return (torch.empty(*chunk, hidden, dtype=dtype, device="meta"),)

    return given


HOST_SHARE = 0.8  # of this machine's available memory a dry run may take


def check_fits(planned_bytes: float, world: int, rank: int) -> None:
    """SpecError naming --world when plan says rank `rank` needs more than HOST_SHARE of the memory
    this machine has available now."""
    from parallel.spec.errors import SpecError

    import psutil

    # psutil's `available` is the kernel's MemAvailable: free pages plus the page cache and slabs
    # it can reclaim. sysconf's SC_AVPHYS_PAGES is MemFree alone, which a host that has just read
    # gigabytes of files reports as a fraction of what it can give (CI, after a test suite: 3.5 GiB
    # "available" of 24, and a 4.1 GiB rank refused)
    available = psutil.virtual_memory().available
    if planned_bytes > HOST_SHARE * available:
        raise SpecError([("--world", f"rank {rank} of {world} would hold about "
                          f"{planned_bytes / 2**30:,.1f} GiB (plan's prediction) and this machine "
                          f"has {available / 2**30:,.1f} GiB available: raise --world, or shard more "
                          "(shard: full, offload), or `polyshard plan` it without building")])


def run(spec, source: str, world: int, rank: int, seq: int, optimizer: str = "adamw") -> DryRun:
    """Build rank `rank` of `world` for `spec` and `source` (a config.json, toy:NAME or a
    module:function) over the fake group, run two steps, measure the second's collectives and the
    first's peak, and put plan's prediction beside them."""
    from parallel.heap import fixed_mmap_threshold
    from parallel.registry import create_engine
    from parallel.tools.bench.measure import CommCounter, held_bytes, step_peak_bytes
    from parallel.tools.parity.cell import optimizer_arg
    from parallel.tools.facts import facts_of
    from parallel.tools.plan import predict
    from parallel.tools.stages import stage_keep
    from parallel.kits.sizes import numel
    from parallel.toy import meta_model

    spec, changed = dryrun_spec(spec, world)
    # plan's prediction first: a rank that would not fit in this machine's memory is refused
    # before anything is allocated (1.7e13 parameters at world 8 allocated 34 GB, then died)
    pp_rank = spec.dims.pp_rank(rank)
    shapes, cfg, unit = facts_of(source, spec, stage_keep(spec, pp_rank))
    est = predict(spec, shapes, cfg, seq, optimizer, unit)
    check_fits(est.total, world, rank)
    fixed_mmap_threshold()  # a dry run's host memory is its tensors' (heap.py)
    join_fake_world(rank, world, spec.topology.procs_per_node)
    engine = create_engine(spec)
    model = meta_model(source)
    # before prepare: TP and FSDP replace the parameters whose shares these are
    shares = kept_shares(model, spec.wrap, spec.topology.tp, spec.topology.tp_plan)
    vocab = model.config.vocab_size
    engine.prepare(model, optimizer_arg(optimizer, 1e-4))
    for part in engine.model_parts:  # a rank's stages: each its own copy of what is not shared
        materialise(part, engine.device)
    if engine.pipeline is not None:  # stages' inputs: what the previous stage would have said
        engine.pipeline.given_inputs = activation_of(model.config, spec.compute)
    params = list(engine.model.parameters())
    grads: dict = {}
    engine.on_gradients.append(lambda e: grads.setdefault("bytes", held_bytes(p.grad for p in params)))
    g = torch.Generator().manual_seed(rank)
    rows = spec.micro_batch_size * spec.grad_accum_steps

    def step():
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        engine.train_step({"input_ids": ids, "labels": ids})

    counter = CommCounter()
    with finite_collectives():
        peak = step_peak_bytes(step)
        with counter.counting():
            step()
    state = [t for s in engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    measured = {"params": held_bytes(params), "grads": grads.get("bytes"),
                "optimizer": held_bytes(state), "peak": peak["peak"] if peak else None}
    planned = {"params": est.params, "grads": est.grads, "optimizer": est.optimizer, "peak": est.total}
    snap, f8 = counter.snapshot(), float8_gathered(spec, shapes, cfg)
    predicted = predicted_collectives(spec, cfg, seq, float(numel(shapes)), shares, pp_rank, f8)
    collectives = {k: {"calls": snap["calls"].get(k, 0), "bytes": snap["bytes"].get(k, 0),
                       "planned": predicted.get(k)}
                   for k in sorted({*snap["calls"], *predicted})}
    engine.close()
    return DryRun(world, rank, spec.topology.tp, measured, planned, collectives, changed,
                  spec.topology.cp)
