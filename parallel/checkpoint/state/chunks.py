"""A rank's piece of a tensor that is a contiguous range of its flattened view (a ZeRO flat-partition
fragment, an XLA FSDP v1 flat shard), written to and read from the portable DCP state in place, as
chunks of the full tensor: no rank ever holds the whole tensor (docs/checkpoint-format.md).

A range [start, start + n) of a row-major tensor is a union of at most 2(d-1)+1 rectangular blocks
(for a matrix: a partial first row, whole rows, a partial last row). `FlatRange` presents those
blocks to DCP through DCP's `_Checkpointable` hooks (the ones DTensor implements), each block a view
of the rank's own storage with a storage of its own size (exact_view): DCP writes it as it is, and
reads into it on load. A plain view would be cloned by DCP's writer, and the clones of a whole save
stayed alive until it ended (measured: views of a 200 MB flat tensor cost 200 MB during dcp.save,
plain tensors nothing; a ZeRO-2 rank's save held 0.45 of the whole model + optimizer state).
`Shards` carries a DTensor's or ShardedTensor's pieces the same way once staged for a background
write (checkpoint.async_save).
"""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.tensor import DTensor


def blocks(shape: tuple[int, ...], start: int, numel: int) -> list[tuple[tuple, tuple, int]]:
    """The rectangular blocks covering flat range [start, start + numel) of a row-major `shape`:
    (offsets, sizes, position of the block's first element within the range), in order."""
    if numel <= 0:
        return []
    if len(shape) <= 1:
        return [((start,), (numel,), 0)] if shape else [((), (), 0)]
    row = math.prod(shape[1:])
    out, pos, end = [], start, start + numel
    while pos < end:
        r, col = divmod(pos, row)
        if col == 0 and end - pos >= row:  # whole rows: one block
            rows = (end - pos) // row
            out.append(((r, *[0] * (len(shape) - 1)), (rows, *shape[1:]), pos - start))
            pos += rows * row
        else:  # part of one row: the row's own blocks, one dimension down
            take = min(end - pos, row - col)
            out += [((r, *off), (1, *size), pos - start + at)
                    for off, size, at in blocks(shape[1:], col, take)]
            pos += take
    return out


def exact_view(view: torch.Tensor) -> torch.Tensor:
    """The same memory as the contiguous `view`, as a tensor whose storage is exactly its own
    elements (a slice of the storage shares it): DCP's writer clones any tensor whose storage is
    larger than itself, this one it writes in place."""
    if not view.is_contiguous() or view.untyped_storage().nbytes() == view.numel() * view.element_size():
        return view
    size = view.element_size()
    start = view.storage_offset() * size
    storage = view.untyped_storage()[start:start + view.numel() * size]
    return torch.empty(0, dtype=view.dtype, device=view.device).set_(storage, 0, view.shape,
                                                                      view.stride())


@dataclass(frozen=True)
class Box:
    """Where a rank's local tensor sits in the full one: a tensor-parallel shard is the block of
    `full` shape starting at `origin` (a column split: rows [o, o + n) of the weight)."""

    full: tuple[int, ...]
    origin: tuple[int, ...]

    @classmethod
    def split(cls, full, dim: int, sizes, index: int) -> Box:
        """Part `index` of `full` split along `dim` into `sizes`."""
        origin = [0] * len(full)
        origin[dim] = sum(sizes[:index])
        return cls(tuple(full), tuple(origin))


class FlatRange:
    """`data` (1-D, this rank's storage) holds elements [start, start + data.numel()) of the
    flattened tensor of `shape`, which is the whole tensor, or with `box` the block of the whole
    tensor a tensor-parallel rank holds. Save and load it with DCP like a DTensor shard."""

    def __init__(self, data: torch.Tensor, start: int, shape, box: Box | None = None):
        self.data, self.start = data, start
        self.shape = torch.Size(box.full if box else shape)  # what DCP stores: the whole tensor
        origin = box.origin if box else (0,) * len(self.shape)
        # blocks of the local tensor, moved to where it sits in the whole one
        self._blocks = [(tuple(o + b for o, b in zip(off, origin)), size, at)
                        for off, size, at in blocks(tuple(shape), start, data.numel())]
        self._views = {off: exact_view(data[at:at + math.prod(size)].view(size))
                       for off, size, at in self._blocks}

    def size(self) -> torch.Size:  # DCP's load planner compares it with the stored global shape
        return self.shape

    def over(self, data: torch.Tensor) -> FlatRange:
        """The same range and blocks held in `data` instead (a staged host copy of `self.data`)."""
        other = copy.copy(self)
        other.data = data
        other._views = {off: exact_view(data[at:at + math.prod(size)].view(size))
                        for off, size, at in self._blocks}
        return other

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.data)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(off),
                                                         sizes=torch.Size(size)),
                              properties=props, size=self.shape))
                for off, size, _ in self._blocks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size))
                for off, size, _ in self._blocks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._views[tuple(index.offset)]

    def __repr__(self) -> str:
        return f"FlatRange({self.start}+{self.data.numel()} of {tuple(self.shape)})"


class Shards:
    """A rank's pieces of a sharded tensor (a DTensor's local shard, a ShardedTensor's local shards)
    as DCP writes them: the tensor's own write items (chunks, properties, global shape), each with a
    copy of its data, and nothing else: no device mesh, process group or device behind them. A
    background writer, a thread or another process (background/saver.py), writes exactly what DCP
    would have written of the original (same keys, chunks and metadata)."""

    def __init__(self, shape: torch.Size, pieces: list[tuple[ChunkStorageMetadata, TensorProperties,
                                                              torch.Tensor]]):
        self.shape, self.pieces = torch.Size(shape), pieces

    @staticmethod
    def sources(obj, geometry: dict | None = None
                ) -> list[tuple[ChunkStorageMetadata, TensorProperties, torch.Tensor]]:
        """(chunk, properties, this rank's data) of every piece DCP would write of `obj` (none for
        a DTensor whose mesh this rank is not on, as DCP's own local plan skips it). `geometry`:
        a DTensor's chunk and properties by (global shape, mesh, placements, local dtype), and by
        the DTensor's id (a weak reference to it, its local dtype and device), kept from save to
        save: DCP works them out in Python per tensor (measured on an H200, 124M Llama: two thirds
        of the time an async save blocked). Call under torch.no_grad()."""
        if isinstance(obj, DTensor):
            local = obj.to_local()  # no_grad: the local tensor itself
            # the same DTensor as at the last save (its mesh, placements and shape are fixed),
            # its shard still of the same dtype: the layout looked up below without hashing the mesh
            kept = None if geometry is None else geometry.get(id(obj))
            if (kept is not None and kept[0]() is obj and type(local) is torch.Tensor
                    and kept[1] == (local.dtype, local.device.type)):
                return [(*kept[2], local)]
            if obj.device_mesh.get_coordinate() is None:
                return []
            if type(local) is torch.Tensor and geometry is not None:
                key = (obj.shape, obj.device_mesh, tuple(obj.placements), local.dtype,
                       local.layout, local.device.type)
                if key not in geometry:
                    (item,) = _create_write_items("t", obj)
                    geometry[key] = (item.tensor_data.chunk, item.tensor_data.properties)
                geometry[id(obj)] = (weakref.ref(obj), (local.dtype, local.device.type), geometry[key])
                return [(*geometry[key], local)]
        return [(item.tensor_data.chunk, item.tensor_data.properties,
                 find_state_dict_object({"t": obj}, item.index))
                for item in _create_write_items("t", obj)]

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, properties=props, size=self.shape))
                for chunk, props, _ in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [chunk for chunk, _, _ in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        offsets = torch.Size(index.offset)
        return next(data for chunk, _, data in self.pieces if chunk.offsets == offsets)

    def __repr__(self) -> str:
        return f"Shards({len(self.pieces)} of {tuple(self.shape)})"


def _swap_ranges(tree: dict, ranges: dict, prefix: tuple = ()) -> dict:
    """Without `ranges`: replace each FlatRange in the nested dict by an empty tensor and return
    {path: FlatRange}; with them: put them back."""
    found = {}
    for key, value in tree.items():
        path = (*prefix, key)
        if isinstance(value, dict):
            found.update(_swap_ranges(value, ranges, path))
        elif path in ranges:
            tree[key] = ranges[path]
        elif isinstance(value, FlatRange):
            found[path], tree[key] = value, torch.empty(0)
    return found


def _block(state_dict: dict, index: MetadataIndex):
    obj = state_dict.get(index.fqn)
    return obj.__get_tensor_shard__(index) if isinstance(obj, (FlatRange, Shards)) else None


class RangeSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds the blocks of a FlatRange and the pieces of
    staged Shards (DCP looks up shards only on torch.Tensor objects).

    `cache`: DCP's plan caching under that key (#44): when every rank's plan equals its previous
    save's, ranks send empty plans and the coordinator reuses its deduplicated global plan and
    index, work that grows with the world size. torch keeps the cache in SavePlanner's class
    attributes keyed by the planner's class name; a key per kind of save keeps a model-only save
    from replacing the checkpoint's plan. The data is resolved at write time, so values may change
    between saves; a changed layout is planned again."""

    def __init__(self, cache: str | None = None):
        super().__init__(enable_plan_caching=cache is not None)
        if cache is not None:
            self._cached_plans_key = f"polyshard:{cache}"

    def lookup_object(self, index: MetadataIndex):
        found = _block(self.state_dict, index)
        return super().lookup_object(index) if found is None else found


class RangeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading into the blocks of a FlatRange in place."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's set-up walks the state and replaces every object it does not know with None (in
        # place): the ranges sit out the walk as empty tensors and are put back by key.
        ranges = _swap_ranges(state_dict, {})
        super().set_up_planner(state_dict, metadata, is_coordinator)
        _swap_ranges(state_dict, ranges)
        for fqn, path in self.mappings.items():
            if path in ranges:
                self.state_dict[fqn] = ranges[path]

    def lookup_tensor(self, index: MetadataIndex):
        found = _block(self.state_dict, index)
        return super().lookup_tensor(index) if found is None else found


class Kept:
    """What a save built from a rank's live state (views, names), kept for the next saves while
    `key` (the tensors it views: ids and storage) is unchanged: a step updates them in place. The
    one mechanism of LiveState (FSDP2), LiveShards (ZeRO) and LiveFlat (FSDP1); each owner clears
    it before a load."""

    def __init__(self):
        self.key: tuple | None = None
        self.value = None

    def clear(self) -> None:
        self.key, self.value = None, None

    def get(self, key: tuple, build):
        """The kept value while `key` is unchanged, else build()'s value, kept when it says so:
        build() returns (value, keep)."""
        if self.key is not None and key == self.key:
            return self.value
        value, keep = build()
        self.key, self.value = (key, value) if keep else (None, None)
        return value
