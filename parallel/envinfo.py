"""Facts about the host read from its environment (no torch import: the registry and CLI use these)."""

from __future__ import annotations

import os


def detect_pjrt_device() -> str:
    """PJRT_DEVICE for XLA: an exported value wins; TPU when the host has TPU chips (TPU VMs expose
    /dev/accel* or /dev/vfio/*); else CPU. Set explicitly, so transformers never prints its
    'Defaulting to PJRT_DEVICE=CPU' guess and nothing runs on the wrong device silently."""
    if os.environ.get("PJRT_DEVICE"):
        return os.environ["PJRT_DEVICE"]
    tpu = any(os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0"))
    return "TPU" if tpu else "CPU"
