"""`deepspeed:`, DeepSpeed's own section of the spec (the descriptor adds it to the spec).

Knobs that exist on DeepSpeed only; anything else goes through `native:`, a DeepSpeed config merged
last and checked against the spec."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from parallel.spec.errors import rule_error
from parallel.spec.sections import Section


class DeepSpeedOptions(Section):
    zero_init: Annotated[
        bool, Field(description="ZeRO-3: construct the model inside deepspeed.zero.Init (pass a "
                    "model factory) so no rank ever holds all parameters; the analogue of "
                    "cpu_ram_efficient_loading.")
    ] = False
    gather_16bit_weights_on_model_save: Annotated[
        bool, Field(description="ZeRO-3: gather full weights when saving "
                    "(stage3_gather_16bit_weights_on_model_save).")
    ] = True
    cpu_adam: Annotated[
        bool, Field(description="With offload, replace a client Adam/AdamW by DeepSpeed's compiled "
                    "CPU Adam (faster; compiled on first use). Off keeps the client optimizer.")
    ] = False
    offload_device: Annotated[
        Literal["cpu", "nvme"],
        Field(description="Where `offload` puts what it offloads: host memory, or NVMe files "
              "under nvme_path (DeepSpeed's ZeRO-Infinity)."),
    ] = "cpu"
    nvme_path: Annotated[
        str | None, Field(description="Directory on local NVMe for offload_device: nvme.")
    ] = None
    reduce_bucket_size: Annotated[
        int | None, Field(gt=0, description="Elements per gradient reduction bucket, allocated "
                          "whole at ZeRO-1/2/3 (unset: min(5e8, the model's trainable "
                          "parameters), where DeepSpeed's own 5e8 would hold 1.9 GiB per rank in "
                          "fp32 whatever the model; DeepSpeed refuses 0).")
    ] = None
    prefetch_bucket_size: Annotated[
        int | None, Field(ge=0, description="ZeRO-3: elements prefetched ahead of use (unset: "
                          "DeepSpeed's 5e7).")
    ] = None
    param_persistence_threshold: Annotated[
        int | None, Field(ge=0, description="ZeRO-3: parameters smaller than this stay unsharded "
                          "(unset: DeepSpeed's 1e5).")
    ] = None
    deepcompile: Annotated[
        bool, Field(description="With compile: {enabled: true, scope: model}: DeepSpeed's "
                    "DeepCompile (compiler passes that place ZeRO's gathers and reductions inside "
                    "the compiled graph). DeepSpeed 0.19.8 runs it on CUDA only.")
    ] = False
    native: Annotated[
        dict[str, Any] | str,
        Field(description="A DeepSpeed config dict or a path to its JSON, merged last. \"auto\" "
              "values are filled from the spec; a value that contradicts the spec is an error."),
    ] = {}


    @model_validator(mode="after")
    def _nvme(self) -> DeepSpeedOptions:
        if (self.offload_device == "nvme") != (self.nvme_path is not None):
            raise rule_error(("deepspeed.nvme_path", "is required by offload_device: nvme, and "
                              "read only with it; set both or neither"))
        return self
