"""`fsdp:`, torch FSDP's own section of the spec (the descriptor adds it to the spec).

Knobs that exist on torch FSDP only; anything else goes through `native:`, which the backend merges last
and checks against the spec."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from parallel.spec.errors import rule_error
from parallel.spec.sections import Section


class FsdpOptions(Section):
    version: Annotated[
        Literal[1, 2],
        Field(description="2: per-parameter `fully_shard` (DTensor). 1: FullyShardedDataParallel "
              "with flat parameters."),
    ] = 2
    backward_prefetch: Annotated[
        Literal["backward_pre", "backward_post", "none"],
        Field(description="When to all-gather the next unit's parameters in backward. FSDP2 always "
              "prefetches before the current unit's gradient computation (backward_pre)."),
    ] = "backward_pre"
    forward_prefetch: Annotated[
        bool, Field(description="All-gather the next unit's parameters before the current forward.")
    ] = False
    sync_module_states: Annotated[
        bool, Field(description="Broadcast rank 0's parameters and buffers before sharding, so "
                    "every rank starts from the same weights.")
    ] = True
    cpu_ram_efficient_loading: Annotated[
        bool, Field(description="Only rank 0 materialises the model (pass a model factory to "
                    "`prepare`); other ranks build it on the meta device and receive rank 0's "
                    "weights. Needs sync_module_states.")
    ] = False
    use_orig_params: Annotated[
        bool, Field(description="FSDP1: expose original parameters (needed for per-parameter "
                    "optimizer groups and torch.compile). FSDP2 always does.")
    ] = True
    limit_all_gathers: Annotated[
        bool, Field(description="FSDP1: rate-limit all-gathers to bound memory.")
    ] = True
    reshard_output: Annotated[
        bool, Field(description="FSDP2: also reshard the output unit (final norm and output layer, "
                    "or tied embeddings) after forward. Off (torchtitan's default): backward needs "
                    "it first, so it stays gathered from its forward to its backward; on: saves "
                    "its unsharded size in that gap (Llama-3-8B: 525M parameters, 1 GiB in bf16) "
                    "for one more all-gather of it per step (torchtitan's "
                    "reshard_after_forward_policy: always).")
    ] = False
    native: Annotated[
        dict[str, Any],
        Field(description="Keyword arguments passed to fully_shard (v2) or FullyShardedDataParallel "
              "(v1), merged last; a key that contradicts the spec is an error."),
    ] = {}

    @model_validator(mode="after")
    def _version_rules(self) -> FsdpOptions:
        if self.cpu_ram_efficient_loading and not self.sync_module_states:
            raise rule_error(("fsdp.sync_module_states", "must be true when "
                              "cpu_ram_efficient_loading is true (other ranks start empty and "
                              "receive rank 0's weights); set `sync_module_states: true`"))
        if self.version == 2 and not self.use_orig_params:
            raise rule_error(("fsdp.use_orig_params", "false is an FSDP1 option: FSDP2 always keeps "
                              "original parameters; remove it or set `fsdp.version: 1`"))
        if self.version == 1 and self.reshard_output:
            raise rule_error(("fsdp.reshard_output", "is an FSDP2 option (FSDP1 reshards by "
                              "sharding strategy); remove it or set `fsdp.version: 2`"))
        if self.version == 2 and self.backward_prefetch != "backward_pre":
            raise rule_error(("fsdp.backward_prefetch", f"{self.backward_prefetch!r} needs FSDP1: "
                              "FSDP2 always prefetches backward_pre; use `backward_prefetch: "
                              "backward_pre` or `fsdp.version: 1`"))
        return self
