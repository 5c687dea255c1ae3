"""Accelerate's own code run as on the GPU host a file is for: its FSDP plugin asks for the
accelerator when it syncs module states (accelerate 1.16 refuses the CPU there) and for the current
device. The one place the unit tests stand in a GPU for accelerate's oracle."""

from contextlib import contextmanager
from unittest import mock

import torch


@contextmanager
def gpu_host():
    with mock.patch("accelerate.utils.dataclasses.get_torch_accelerator_backend",
                    lambda *_, **__: ("cuda", torch.cuda)), \
            mock.patch.object(torch.cuda, "current_device", lambda: 0):
        yield
