"""The parallel layout of a job, owned in one place: data parallel as replicas x shard groups, and the
tensor-parallel degree. Built from the spec (`spec.dims`); everything that means "how many copies of
the batch are there" (the batch rule, the dataloader's rank and size, tokens per step, DeepSpeed's
train_batch_size, the plan's shard count, bench and parity slicing) asks it for the data-parallel
size and rank instead of using the world size, so tensor parallelism needs no change there."""

from __future__ import annotations

from dataclasses import dataclass

HYBRID = ("hybrid", "hybrid_grad_op")
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int  # replicas of the sharded model (hybrid sharding, or plain replication)
    dp_shard: int  # ranks one copy of the model is sharded over
    tp: int = 1  # tensor-parallel degree (a backend without tensor parallelism refuses tp != 1)

    @classmethod
    def from_spec(cls, spec) -> ParallelDims:
        # processes only: under SPMD one process's device mesh holds TP (spec.process_tp)
        tp = getattr(spec, "process_tp", spec.topology.tp)
        dp = max(1, spec.world_size // tp)  # a tp that does not divide is the spec's error to report
        if spec.shard in HYBRID:
            # default: shard inside a host, whose procs_per_node ranks hold procs_per_node / tp
            # data-parallel ranks (tp is the innermost dimension)
            group = spec.topology.shard_group_size or max(1, spec.topology.procs_per_node // tp)
            return cls(max(1, dp // group), group, tp)
        if spec.shard == "none":  # replicate everything: every rank its own "shard group" of one
            return cls(dp, 1, tp)
        return cls(1, dp, tp)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp

    def dp_rank(self, rank: int) -> int:
        """Ranks are laid out as the mesh is, (dp_replicate, dp_shard, tp) row-major: tp varies
        fastest, so a tp group is `tp` consecutive ranks (one host's GPUs: tp's all-reduces stay on
        NVLink) and shares one slice of the batch."""
        return rank // self.tp

    def device_mesh(self, device_type: str):
        """The torch DeviceMesh over every dimension, named MESH_DIMS (size-1 dims included, so
        `mesh["dp_shard"]` and `mesh["tp"]` always exist)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.tp),
                                mesh_dim_names=MESH_DIMS)
