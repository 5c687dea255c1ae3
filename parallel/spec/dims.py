"""The parallel layout of a job, owned in one place: data parallel as replicas x shard groups, and the
model-parallel dimensions (tensor, context, pipeline, expert). Built from the spec (`spec.dims`);
everything that means "how many copies of the batch are there" (the batch rule, the dataloader's rank
and size, tokens per step, DeepSpeed's train_batch_size, the plan's shard count, bench and parity
slicing) asks it for the data-parallel size and rank instead of using the world size, so a new
dimension needs no change there.

Every dimension has a slot here and a field in `topology`; a backend declares the ones it implements
(its descriptor's `dimensions`), and the spec refuses any other above 1 with the reason, at validation.
"""

from __future__ import annotations

from dataclasses import dataclass

HYBRID = ("hybrid", "hybrid_grad_op")
# The dimensions beyond data parallelism, outermost first as the mesh orders them (torchtitan's
# order: pipeline stages span hosts, tensor parallelism is innermost so its all-reduces stay on one
# host's links); expert parallelism borrows ranks from data and context parallelism (it is no
# factor of the world size). What each means, for the refusal of a backend that lacks it.
MODEL_DIMS = {
    "pp": "pipeline parallelism (the layers split into stages over ranks)",
    "cp": "context parallelism (each sequence split over ranks)",
    "tp": "tensor parallelism (the projections split over ranks)",
    "ep": "expert parallelism (mixture-of-experts layers' experts split over ranks)",
}
DOCS = {"pp": "docs/pipeline.md", "cp": "docs/long-sequences.md", "tp": "docs/tp.md",
        "ep": "docs/moe.md"}


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int  # replicas of the sharded model (hybrid sharding, or plain replication)
    dp_shard: int  # ranks one copy of the model is sharded over
    tp: int = 1  # tensor-parallel degree (a backend without tensor parallelism refuses tp != 1)
    cp: int = 1  # context-parallel degree: ranks one sequence is split over
    pp: int = 1  # pipeline stages
    ep: int = 1  # expert-parallel degree (borrowed from dp_shard x cp, as torchtitan does)

    @classmethod
    def from_spec(cls, spec) -> ParallelDims:
        t = spec.topology
        # processes only: under SPMD one process's device mesh holds TP (spec.process_tp)
        tp = getattr(spec, "process_tp", t.tp)
        cp = getattr(spec, "process_cp", t.cp)  # likewise its sequence axis
        # a product that does not divide the world is the spec's error to report
        dp = max(1, spec.world_size // (tp * cp * t.pp))
        more = {"tp": tp, "cp": cp, "pp": t.pp, "ep": t.ep}
        if spec.shard in HYBRID:
            # default: shard inside a host, whose procs_per_node ranks hold procs_per_node / (tp x
            # cp) data-parallel ranks (tp and cp are the innermost dimensions)
            group = t.shard_group_size or max(1, t.procs_per_node // (tp * cp))
            return cls(max(1, dp // group), group, **more)
        if spec.shard == "none":  # replicate everything: every rank its own "shard group" of one
            return cls(dp, 1, **more)
        return cls(1, dp, **more)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_size * self.cp * self.tp

    @property
    def dp_cp(self) -> int:
        """The ranks that hold different tokens of a step (data parallel x context parallel): the
        gradients are averaged over them and the step's targets counted over them."""
        return self.dp_size * self.cp

    def cp_rank(self, rank: int) -> int:
        """This rank's place in its cp group: which slice of each row it keeps."""
        return (rank // self.tp) % self.cp

    def pp_rank(self, rank: int) -> int:
        """This rank's place in its pipeline (pp is the outermost dimension)."""
        return rank // (self.dp_size * self.cp * self.tp)

    def dp_rank(self, rank: int) -> int:
        """Ranks are laid out as the mesh is, (pp, dp_replicate, dp_shard, cp, tp) row-major: tp
        varies fastest, so a tp group is `tp` consecutive ranks (one host's GPUs: tp's all-reduces
        stay on NVLink), and every rank of a cp x tp block shares one slice of the batch."""
        return (rank // (self.cp * self.tp)) % self.dp_size

    @property
    def dp_mod_ep(self) -> int:
        """The ranks of dp_shard x cp that hold the same experts (what ep leaves of the ranks it
        borrows, torchtitan's dp_shard_mod_ep): each expert is sharded over them."""
        return self.dp_shard * self.cp // self.ep

    def expert_mesh(self, device_type: str):
        """The mesh experts live on: the engine's ranks as (pp, dp_replicate, dp_mod_ep, ep, tp),
        dp_shard x cp split into (dp_mod_ep, ep) with ep inner (its all-to-alls between
        neighbouring ranks, one host's links first); the same rank order as `device_mesh`."""
        from torch.distributed.device_mesh import init_device_mesh

        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_mod_ep": self.dp_mod_ep,
                 "ep": self.ep, "tp": self.tp}
        names = tuple(n for n, v in sizes.items() if v > 1 or n in ("dp_replicate", "dp_mod_ep"))
        return init_device_mesh(device_type, tuple(sizes[n] for n in names), mesh_dim_names=names)

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The mesh's dimension names: dp_replicate, dp_shard and tp always (size 1 included, so
        `mesh["dp_shard"]` and `mesh["tp"]` always exist), pp and cp where they are above 1 (a
        size-1 dimension still costs a process group per rank at start-up)."""
        return tuple(n for n in ("pp", "dp_replicate", "dp_shard", "cp", "tp")
                     if n in ("dp_replicate", "dp_shard", "tp") or getattr(self, n) > 1)

    def device_mesh(self, device_type: str):
        """The torch DeviceMesh over every dimension of `mesh_dims`."""
        from torch.distributed.device_mesh import init_device_mesh

        names = self.mesh_dims
        return init_device_mesh(device_type, tuple(getattr(self, n) for n in names),
                                mesh_dim_names=names)

    def problems(self, backend) -> list[tuple[str, str]]:
        """(field, message) for each model-parallel dimension above 1 that `backend` (its
        descriptor: `dimensions`, and `lacking`, why not) does not implement, or whose degree does
        not fit the layout."""
        implemented, out = backend.dimensions, []
        for name, what in MODEL_DIMS.items():
            degree = getattr(self, name)
            if degree > 1 and name not in implemented:
                has, why = ", ".join(sorted(implemented)) or "none", backend.lacking.get(name)
                why = f": {why}" if why else f" (its dimensions beyond data parallelism: {has})"
                out.append((f"topology.{name}", f"{degree}: backend {backend.name!r} does not implement "
                            f"{what}{why}; use {name}: 1 ({DOCS[name]})"))
        if self.ep > 1 and "ep" in implemented and (self.dp_shard * self.cp) % self.ep:
            replicas = (f" (dp_replicate {self.dp_replicate}: replicas, which experts are not "
                        "split over; shard: full, or a larger shard group, gives dp_shard)"
                        ) if self.dp_replicate > 1 else ""
            out.append(("topology.ep", f"{self.ep} must divide the ranks it borrows from, dp_shard "
                        f"x cp = {self.dp_shard * self.cp}{replicas}; pick a divisor of it"))
        return out


def world_problems(world: int, product: int, topology) -> list[tuple[str, str]]:
    """The model-parallel product against the world size, named by the dimensions the topology
    sets (cp 4 alone is cp's error, not tp's: it blamed topology.tp)."""
    if world % product == 0:
        return []
    degrees = {n: getattr(topology, n) for n in ("tp", "cp", "pp")}
    named = [n for n, v in degrees.items() if v > 1]
    what = f"{product} (" + " x ".join(f"{n} {degrees[n]}" for n in named) + ")" \
        if len(named) > 1 else f"{product}"
    return [(" x ".join(f"topology.{n}" for n in named), f"{what} does not divide the world size "
             f"{world}; pick degrees whose product divides it, or change the world size")]


def batch_problems(spec) -> list[tuple[str, str]]:
    """global_batch_size against micro_batch_size x grad_accum_steps x the data-parallel size
    (under SPMD the devices are known at run time: the engine checks then)."""
    devices = spec.descriptor(spec.backend).launch.process_devices(spec)
    if spec.global_batch_size is None or devices is None:
        return []
    dp = spec.dims.dp_size  # tensor-parallel ranks share a batch
    per_step = spec.micro_batch_size * spec.grad_accum_steps * dp * devices
    if per_step == spec.global_batch_size:
        return []
    return [("global_batch_size", f"{spec.global_batch_size} != micro_batch_size "
             f"{spec.micro_batch_size} x grad_accum_steps {spec.grad_accum_steps} x "
             f"{dp} data-parallel rank(s) = {per_step}; change one of them (e.g. "
             "--set topology.procs_per_node=N) so the product is the global batch")]
