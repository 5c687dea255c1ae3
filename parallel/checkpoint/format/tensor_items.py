"""DCP's items read at the disk's speed (#44), for SafeReader (parallel/checkpoint/format/safe.py).

torch's FileSystemReader reads each item through a bounded wrapper over the file, in plan order,
and unpickles every tensor item with `torch.load(weights_only=True)`: a zip archive parsed and a
pickle run per item, about 2 ms each. A ZeRO-3 save of the 56M Llama at 2 ranks holds 306 of them
per rank: 0.59 s of a 1.26 s load. Here each file's items are read in offset order, each with one
read, and a tensor item is unpickled once per distinct pickle: tensors of one dtype, shape and
stride are saved as the same pickle bytes (a save's 526 items held 7), so the first of each is
loaded with torch.load as DCP loads it and its layout kept by those bytes; a later item with the
same bytes is a view of its storage record in what was read. A checkpoint with DCP's stream
transforms (compression, extensions) is read by DCP's own reader.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import torch
from torch.futures import Future


class DamagedItemError(ValueError):
    """An item that is not what its index says (cut short, not a torch.save archive); the message
    names the file. SafeReader raises it as UnsafeFileError."""


class TensorItems:
    """torch.save'd single tensors (DCP's tensor items) by the layout of their pickle."""

    def __init__(self, unpickle=None):
        """`unpickle(file, what)`: the project's one unpickler of foreign files (safe.torch_load,
        which SafeReader hands over): a code pickle refused naming what it asked for, never a
        traceback (#65: this called torch.load itself); None: torch's weights_only load."""
        self._layouts: dict[bytes, tuple | None] = {}  # pickle bytes -> layout (None: torch.load)
        self._load = unpickle or (lambda file, what: torch.load(file, map_location="cpu",
                                                                  weights_only=True))

    def _unpickle(self, raw: bytes, name: str) -> torch.Tensor:
        return self._load(_Named(raw, name), "a tensor item of a DCP checkpoint")

    def load(self, raw: bytes, name: str = "a DCP item") -> torch.Tensor:
        try:
            archive = torch._C.PyTorchFileReader(io.BytesIO(raw))
            pickled = archive.get_record("data.pkl")
        except RuntimeError as err:  # torch.load would fail the same way on it
            raise ValueError(f"not a torch.save archive ({str(err).splitlines()[0]})") from None
        if pickled not in self._layouts:
            tensor = self._unpickle(raw, name)
            self._layouts[pickled] = _layout(archive, tensor)
            return tensor
        layout = self._layouts[pickled]
        if layout is None:
            return self._unpickle(raw, name)
        record, dtype, nbytes, size, stride, offset = layout
        start = archive.get_record_offset(record)
        if start + nbytes > len(raw):
            raise ValueError(f"its storage record {record!r} ends past the item")
        with warnings.catch_warnings():  # read only: copied into the destination at once
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(raw, dtype=torch.uint8, count=nbytes, offset=start)
        return flat.view(dtype).as_strided(size, stride, offset)


class _Named(io.BytesIO):
    """An item's bytes, named by its file in what safe.torch_load says."""

    def __init__(self, raw: bytes, name: str):
        super().__init__(raw)
        self.name = name


def _layout(archive, tensor) -> tuple | None:
    """What a later item with the same pickle needs, or None where only torch.load will do (not a
    plain tensor, several storages, big-endian data)."""
    records = [r for r in archive.get_all_records() if r.startswith("data/")]
    little = not archive.has_record("byteorder") or archive.get_record("byteorder") == b"little"
    if (type(tensor) is not torch.Tensor or tensor.layout != torch.strided or len(records) != 1
            or not little or tensor.untyped_storage().nbytes() == 0):
        return None
    return (records[0], tensor.dtype, tensor.untyped_storage().nbytes(), tuple(tensor.shape),
            tensor.stride(), tensor.storage_offset())


def read_items(reader, plan, planner, load_bytes, unpickle=None, open_file=None) -> Future:
    """DCP's FileSystemReader.read_data (torch 2.9) for items without stream transforms: byte
    entries go to `load_bytes(item, BytesIO)`, tensors into the planner's destinations."""
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.planner import LoadItemType

    per_file: dict[str, list] = {}
    for item in plan.items:
        info = reader.storage_data[item.storage_index]
        per_file.setdefault(info.relative_path, []).append((info.offset, info.length, item))
    tensors = TensorItems(unpickle)
    open_file = open_file or (lambda path: reader.fs.create_stream(path, "rb"))
    for name, items in per_file.items():
        path = reader.fs.concat_path(reader.path, name)
        with open_file(path) as stream:  # no link, no FIFO: a regular file of the checkpoint
            size = os.fstat(stream.fileno()).st_size
            for offset, length, item in sorted(items, key=lambda x: x[0]):
                if offset < 0 or length < 0 or offset + length > size:  # before any allocation
                    raise DamagedItemError(f"{Path(path)}: the item of {item.dest_index.fqn} lies "
                                           f"at {offset}, {length} bytes, outside the file's "
                                           f"{size}; the checkpoint is damaged or crafted")
                stream.seek(offset)
                raw = stream.read(length)
                if len(raw) != length:
                    raise DamagedItemError(f"{Path(path)}: the item of {item.dest_index.fqn} ends "
                                           f"past the file ({len(raw)} of {length} bytes at "
                                           f"{offset}); the checkpoint is damaged")
                if item.type == LoadItemType.BYTE_IO:
                    load_bytes(item, io.BytesIO(raw))
                    continue
                try:
                    whole = tensors.load(raw, f"{Path(path)}: {item.dest_index.fqn}")
                except ValueError as err:
                    raise DamagedItemError(f"{Path(path)}: the item of {item.dest_index.fqn}: "
                                           f"{err}; the checkpoint is damaged") from None
                tensor = narrow_tensor_by_index(whole, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    raise ValueError(f"{Path(path)}: {item.dest_index.fqn} holds "
                                     f"{tuple(tensor.size())}, the load asks for "
                                     f"{tuple(target.size())}")
                target.copy_(tensor)
                planner.commit_tensor(item, target)
    done: Future = Future()
    done.set_result(None)
    return done
