"""XLA FSDP specs as HF Trainer arguments (fsdp_config with transformers' XLA keys). accelerate has no
XLA FSDP: the descriptor states it as an unsupported export."""

from __future__ import annotations

from parallel.interop.exporting import trainer_args, trainer_document, trainer_layers
from parallel.spec.model import Spec


def to_hf_trainer(spec: Spec) -> dict:
    config = {"xla": True, "xla_fsdp_v2": spec.xla.fsdp_version == 2,
              "xla_fsdp_grad_ckpt": spec.checkpoint_activations,
              "xla_fsdp_settings": {k: v for k, v in spec.xla.xla_fsdp_settings.items()
                                    if k != "xla_fsdp_grad_ckpt"}, **trainer_layers(spec)}
    # transformers 5: `fsdp: true`; its XLA path reads fsdp_config alone (xla_fsdp_settings)
    return trainer_document({**trainer_args(spec), "fsdp": True, "fsdp_config": config})
