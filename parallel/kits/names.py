"""A parameter's portable name: what wrapper modules (FSDP1, activation checkpointing, torch.compile,
XLA FSDP) insert into `named_parameters()` taken out, so every backend, checkpoint and tool names a
parameter as the model built it."""

from __future__ import annotations

# Wrapper modules insert these into parameter names; the portable names have none of them.
WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_module.",
                 "_fpw_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name
