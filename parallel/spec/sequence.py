"""The spec's section for long rows: a loss computed a tile of tokens at a time, and saved activations
offloaded to host memory. Context parallelism, the third lever, is a dimension (topology.cp)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from parallel.spec.sections import Section


class Sequence(Section):
    loss_tile: Annotated[
        int | None,
        Field(ge=16, le=1 << 24, description="A causal LM's loss computed this many tokens at a "
              "time (each tile's logits recomputed in backward), so the batch's logits, tokens x "
              "vocabulary, are never held whole: at 32k tokens and a 128k vocabulary they are 16 "
              "GiB in fp32. Same loss and gradients as the model's own (within 1e-6). Unset: the "
              "model computes its loss itself."),
    ] = None
    offload_activations: Annotated[
        bool,
        Field(description="Keep the tensors forward saves for backward in host memory (pinned "
              "on CUDA) until backward needs them: activation memory on the device falls to what "
              "one layer holds in flight, at the cost of a host copy each way (torch's "
              "save_on_cpu). With activation_checkpointing only the checkpoints' inputs are "
              "saved, so both together hold the least."),
    ] = False
