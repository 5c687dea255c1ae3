"""The parallel layout of a job: data parallel as replicas x shard groups, and a reserved tensor-parallel
degree, built once per Engine from the spec. The rest of the code asks for data-parallel facts (the
dataloader's rank and size, tokens per step, the plan's shard count) instead of assuming that the
world size is the data-parallel size, so a backend with tensor parallelism needs no core change."""

from __future__ import annotations

from dataclasses import dataclass

HYBRID = ("hybrid", "hybrid_grad_op")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int  # replicas of the sharded model (hybrid sharding, or plain replication)
    dp_shard: int  # ranks one copy of the model is sharded over
    tp: int = 1  # tensor-parallel degree; reserved: every current backend refuses tp != 1

    @classmethod
    def from_spec(cls, spec) -> ParallelDims:
        world, tp = spec.world_size, spec.topology.tp
        dp = world // tp
        if spec.shard in HYBRID:
            group = spec.shard_group_size
            return cls(dp // group, group, tp)
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
        """Ranks are laid out (dp_replicate, dp_shard, tp), tp fastest: a tp group shares a batch."""
        return rank // self.tp

    def device_mesh(self, device_type: str):
        """The torch DeviceMesh over the data-parallel dims (named dp_replicate, dp_shard)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
