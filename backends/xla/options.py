"""`xla:`, PyTorch/XLA's own section of the spec (the descriptor adds it to the spec).

Knobs that exist on PyTorch/XLA only; anything else goes through `native:` (or accelerate's
`xla_fsdp_settings`), merged last."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from parallel.spec.sections import Section


class XlaOptions(Section):
    fsdp_version: Annotated[
        Literal[1, 2],
        Field(description="1: XlaFullyShardedDataParallel, one process per device. 2: SPMD "
              "SpmdFullyShardedDataParallel over a device mesh, one process per host."),
    ] = 1
    xla_fsdp_grad_ckpt: Annotated[
        bool | None,
        Field(description="Accelerate's name for activation checkpointing on XLA "
              "(checkpoint_module on each wrapped unit). Same meaning as activation_checkpointing."),
    ] = None
    flatten_parameters: Annotated[
        bool, Field(description="v1: flatten each unit's parameters into one tensor.")
    ] = True
    mesh_shape: Annotated[
        list[int] | None,
        Field(description="v2: device mesh shape (default: all devices on the `fsdp` axis).")
    ] = None
    compilation_cache: Annotated[
        str | None,
        Field(description="Directory for XLA's persistent compilation cache: a relaunch (resume, "
              "restart) reuses compiled graphs instead of compiling them again. Refused with "
              "torch_xla 2.9, which writes the cache but cannot read it back (docs/xla.md)."),
    ] = None
    preemption_sync: Annotated[
        bool,
        Field(description="v2 (SPMD) on TPU VM slices: agree on a preemption through torch_xla's "
              "preemption sync manager (TSL's SIGTERM notifier and the coordination service every "
              "host joins) instead of the loss reduction; every host then saves at the same step. "
              "Needs checkpoint.dir and preemption_signals: [SIGTERM] (what it listens to)."),
    ] = False
    xla_fsdp_settings: Annotated[
        dict[str, Any],
        Field(description="Accelerate's passthrough of XlaFullyShardedDataParallel arguments "
              "(`xla_fsdp_grad_ckpt` accepted here too)."),
    ] = {}
    native: Annotated[
        dict[str, Any], Field(description="Same as xla_fsdp_settings; merged last.")
    ] = {}

    def neutral(self) -> dict[str, tuple[object, str]]:
        """`xla_fsdp_grad_ckpt` (here or in `xla_fsdp_settings`, either spelling accelerate writes)
        is activation checkpointing."""
        value = self.xla_fsdp_settings.get("xla_fsdp_grad_ckpt", self.xla_fsdp_grad_ckpt)
        return {} if value is None else {"activation_checkpointing": (bool(value),
                                                                      "xla.xla_fsdp_grad_ckpt")}
