"""What each backend supports, as data.

Spec validation reads this table so that `polyshard validate` can reject an unsupported combination
without importing the backend (and its optional dependency). The registry checks that its keys are the
same set of backends it can load. Each rejection carries the reason and the nearest valid choice, so the
error tells the user what to write instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Unsupported:
    """A value a backend cannot honour: why, and what to write instead."""

    reason: str
    nearest: str


@dataclass(frozen=True)
class Capabilities:
    # field name -> {value: Unsupported}; a value absent from the map is supported.
    unsupported: dict[str, dict[str, Unsupported]] = field(default_factory=dict)

    def check(self, field_name: str, value: str) -> Unsupported | None:
        return self.unsupported.get(field_name, {}).get(value)


CAPABILITIES: dict[str, Capabilities] = {
    "fsdp": Capabilities(
        unsupported={
            "shard": {
                "optimizer": Unsupported(
                    "torch FSDP has no optimizer-state-only sharding (that is ZeRO-1)",
                    "shard: grad_op (shards gradients and optimizer state), or backend: deepspeed",
                ),
            },
            "offload": {
                "optimizer": Unsupported(
                    "torch FSDP offloads parameters, gradients and optimizer state together",
                    "offload: params, or backend: deepspeed for optimizer-only offload",
                ),
            },
        }
    ),
    "deepspeed": Capabilities(
        unsupported={
            "shard": {
                "hybrid_grad_op": Unsupported(
                    "ZeRO++ hierarchical partitioning (hpZ) applies to ZeRO-3 parameters only",
                    "shard: hybrid (ZeRO-3 + hpZ), or shard: grad_op (ZeRO-2)",
                ),
            },
        }
    ),
    "xla_fsdp": Capabilities(
        unsupported={
            "shard": {
                "optimizer": Unsupported(
                    "XLA FSDP shards parameters; it has no optimizer-only mode",
                    "shard: grad_op, or backend: deepspeed",
                ),
                "none": Unsupported(
                    "XlaFullyShardedDataParallel always shards parameters",
                    "shard: grad_op (keeps full parameters between forward and backward)",
                ),
                "hybrid": Unsupported(
                    "XLA FSDP has no hybrid (replicate x shard) mode",
                    "shard: full",
                ),
                "hybrid_grad_op": Unsupported(
                    "XLA FSDP has no hybrid (replicate x shard) mode", "shard: grad_op"
                ),
            },
            "offload": {
                "optimizer": Unsupported("XLA FSDP has no CPU offload", "offload: none"),
                "params": Unsupported("XLA FSDP has no CPU offload", "offload: none"),
            },
            "precision": {
                "fp16": Unsupported(
                    "TPUs compute in bf16; XLA FSDP has no fp16 loss scaling", "precision: bf16"
                ),
            },
        }
    ),
}
