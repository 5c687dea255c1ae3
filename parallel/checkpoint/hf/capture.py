"""save_pretrained's sink: the backend's portable save of the model, planned by DCP as any save is,
whose write items are kept (`Capture`) for hf_gather.py to write in place in the safetensors files;
nothing is written under the sink's directory."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter
from torch.futures import Future

from parallel.checkpoint.state.sink import Sink


class Capture(StorageWriter):
    """A DCP storage writer that keeps, on each rank, (key, chunk offsets, chunk sizes, tensor) of
    every tensor item its plan gives it, and on the coordinator every stored tensor's global
    shape; nothing is written. One Capture may take several dcp.save calls of one save."""

    def __init__(self):
        super().__init__()
        self.pieces: list[tuple[str, tuple, tuple, torch.Tensor]] = []
        self.shapes: dict[str, tuple[int, ...]] = {}

    def reset(self, checkpoint_id=None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def write_data(self, plan, planner) -> Future:
        for item in plan.items:
            if item.type in (WriteItemType.TENSOR, WriteItemType.SHARD):
                chunk = item.tensor_data.chunk
                self.pieces.append((item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes),
                                    planner.resolve_data(item).detach()))
        done: Future = Future()  # torch's, as DCP waits on it
        done.set_result([])
        return done

    def finish(self, metadata, results) -> None:
        self.shapes.update({k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
                            if isinstance(v, TensorStorageMetadata)})

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


class CaptureSink(Sink):
    """The model section of a save, captured: DCP hands every write item to `capture`."""

    kind = "capture"

    def __init__(self, tmp, capture: Capture):
        super().__init__(tmp, sections=("model",))
        self.capture = capture

    def storage_writer(self) -> Capture:
        return self.capture
