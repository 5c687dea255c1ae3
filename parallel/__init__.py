"""polyshard: one training-strategy spec for torch FSDP, DeepSpeed ZeRO and PyTorch/XLA FSDP.

Importing this package needs neither deepspeed nor torch_xla: backends load lazily through the registry.
"""

__version__ = "0.1.0"  # before the imports below: parallel.engine.base reads it

from parallel.spec.model import Spec
from parallel.spec.io import SpecError, dump_spec, load_spec

__all__ = ["Spec", "SpecError", "dump_spec", "load_spec", "create_engine"]


def create_engine(spec, **kwargs):
    """Build the Engine for `spec.backend` (see parallel.registry)."""
    from parallel.registry import create_engine as _create

    return _create(spec, **kwargs)
