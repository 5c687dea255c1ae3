"""Files from elsewhere are read as data, never as code (docs/security.md).

- Pickles: torch's `weights_only` unpickler for every `.pt` file, ours and foreign (DeepSpeed, XLA),
  with the few classes those formats really hold allowed by name; DCP's `.metadata` index through an
  unpickler that builds DCP's own metadata classes and nothing else; DCP's byte entries checked by
  `weights_only` before DCP reads them. A crafted file is refused naming the file and the global it
  asked for; `--trust-checkpoint` (API: `trust=True`) lifts it for a file whose origin you trust.
- Sizes and kinds: tables and indexes are read through parallel/files.py (regular files only, size
  caps, bounded nesting).
- Names: a name taken from a file (a parameter name, `latest`, a hash table entry) becomes a path only
  if it stays inside its directory.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import torch

from parallel.checkpoint.format.tensor_items import DamagedItemError, read_items
from parallel.files import (FileError, load_json, open_plain, read_bytes, read_text,  # noqa: F401
                            regular_file)


TABLE_LIMIT = 256 << 20  # a manifest or hash table (grows with the files a checkpoint has)
INDEX_LIMIT = 1 << 30  # DCP's .metadata (grows with keys x writers)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupted; the message names the file."""


class UnsafeFileError(CheckpointError, FileError):
    """A checkpoint file that asks for code to run, points outside its directory, or is not the
    data it claims to be; the message names the file and what it asked for."""


def _unsupported(err: Exception) -> str:
    text = str(err)
    for marker in ("Unsupported global: GLOBAL ", "GLOBAL "):
        if marker in text:
            return text.split(marker, 1)[1].split()[0]
    return text.splitlines()[0] if text else type(err).__name__


def torch_load(path: Path | io.BytesIO, what: str, allow: tuple = (), trust: bool = False,
               limit: int | None = None, mmap: bool = False):
    """torch.load of a file from elsewhere: torch's weights_only unpickler (tensors, containers,
    numbers, strings), plus the classes in `allow`. `trust`: full pickle, for a file whose origin you
    trust (it can run any code). `mmap`: tensors mapped from the file, read when touched (a zip
    file only: torch.save's format since 1.6; an older file is read whole). A path that is a
    symbolic link is refused: a file inside a checkpoint directory never reads what lies outside
    it (a Hugging Face hub snapshot links its files into a blob cache: `hf download --local-dir`,
    or `cp -rL`, gives the files themselves)."""
    name = getattr(path, "name", None) or str(path)
    if isinstance(path, (str, Path)):
        regular_file(Path(path), what, limit or (1 << 62), follow=False)
        mmap = mmap and zipfile.is_zipfile(path)
    else:
        mmap = False
    if trust:  # the caller's decision
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise UnsafeFileError(
            f"{name}: refused ({what}): it asks to load {_unsupported(err)}, which is code, not "
            "data. If you trust where this file comes from, pass --trust-checkpoint (API: "
            "trust=True), which lets it run whatever it holds") from None


def _numpy_array() -> tuple:
    """What a pickled numpy array needs (torch's documented allow-list for numpy under
    weights_only): the array's reconstructor, ndarray and its dtype classes."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return (core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)))


NUMPY_ARRAY = _numpy_array()

# DCP's index (.metadata) holds its own dataclasses, torch sizes, dtypes and layouts, and a path.
DCP_CLASSES = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
     ("pathlib", "WindowsPath"), ("collections", "OrderedDict")})
DTYPES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))


def _properties_of_any_torch():
    """DCP's TensorProperties reading the state of a newer torch too: torch 2.15 pickles a sixth
    field (strides) after torch 2.9's five, so an index the main lane wrote loads in the XLA lane's
    torch 2.9 (docs/lanes.md); a torch that knows the field reads it itself."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    if "strides" in getattr(TensorProperties, "__dataclass_fields__", {}):
        return TensorProperties

    class Properties(TensorProperties):
        def __setstate__(self, state):
            super().__setstate__(tuple(state)[:5])

    Properties.__qualname__ = Properties.__name__ = "TensorProperties"
    return Properties


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.distributed.checkpoint.metadata", "TensorProperties"):
            return _properties_of_any_torch()
        if (module, name) in DCP_CLASSES or (module == "torch" and name in DTYPES):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def load_index(path: Path):
    """DCP's .metadata, built from DCP's own classes only."""
    data = read_bytes(path, "a DCP index (.metadata)", INDEX_LIMIT, follow=False)
    try:
        index = _IndexUnpickler(io.BytesIO(data)).load()
        files = {info.relative_path for info in (index.storage_data or {}).values()}
    except pickle.UnpicklingError as err:
        raise UnsafeFileError(f"{path}: refused: it asks to load {_unsupported(err)}, which no DCP "
                              "index holds; the checkpoint was crafted or is damaged") from None
    except Exception as err:  # noqa: BLE001 - any other malformed pickle: name the file
        raise UnsafeFileError(f"{path}: not a readable DCP index ({type(err).__name__}: "
                              f"{err})") from None
    for name in files:  # DCP opens these relative to the directory: they must stay in it
        child_name(name, "its index names the data file", path.parent)
    _check_sizes(index, path)
    return index


def _check_sizes(index, path: Path) -> None:
    """Sizes the index claims, against the data files, before anything is allocated (#65: a
    [2**20, 2**20] tensor was allocated, an item's 2**50-byte length read): every item inside its
    file, and no tensor larger than all the data there is (uncompressed: without DCP's stream
    transforms, every byte of a tensor is stored)."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    data = index.storage_data or {}
    sizes = {}
    for name in {info.relative_path for info in data.values()}:
        try:
            sizes[name] = os.lstat(path.parent / name).st_size
        except OSError:  # a missing file: the read names it
            return
    for info in data.values():
        if not (0 <= info.offset and 0 <= info.length and info.offset + info.length
                <= sizes[info.relative_path]):
            raise UnsafeFileError(f"{path}: an item lies at {info.offset}, {info.length} bytes, "
                                  f"outside {info.relative_path} ({sizes[info.relative_path]} "
                                  "bytes); the checkpoint is damaged or crafted")
    if any(getattr(info, "transform_descriptors", None) for info in data.values()):
        return
    total = sum(sizes.values())
    for fqn, entry in index.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            dims = list(entry.size)
            need = math.prod(dims) * entry.properties.dtype.itemsize
            if any(d < 0 for d in dims) or need > total:
                raise UnsafeFileError(f"{path}: {fqn} claims shape {dims} ({need:,} bytes), more "
                                      f"than the {total:,} bytes of data the checkpoint holds; it "
                                      "is damaged or crafted")


def safe_reader_class(base):
    """A DCP reader class (FileSystemReader or a subclass) that reads the index with load_index and
    checks each byte entry with weights_only before DCP unpickles it (DCP's load_bytes uses full
    pickle: a crafted entry would run code)."""

    class Safe(base):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            rank = kwargs.get("rank", None)
            metadata = load_index(Path(self._get_metadata_path(rank)))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            unchecked = planner.load_bytes

            def checked(read_item, value: io.BytesIO):
                raw = value.getvalue()
                torch_load(io.BytesIO(raw), f"entry {read_item.dest_index.fqn} of {self.path}")
                return unchecked(read_item, io.BytesIO(raw))

            if not any(getattr(self.storage_data[i.storage_index], "transform_descriptors", None)
                       for i in plan.items):
                try:
                    return read_items(self, plan, planner, checked, torch_load, open_data_file)
                except DamagedItemError as err:
                    raise UnsafeFileError(str(err)) from None
            planner.load_bytes = checked  # DCP's own reader, for its stream transforms
            try:
                return super().read_data(plan, planner)
            finally:
                del planner.load_bytes  # the instance attribute: the class's method again

    Safe.__name__ = f"Safe{base.__name__}"
    return Safe


def child_name(name: str, what: str, where: Path) -> str:
    """`name` as one path component inside `where`: no separators, no '..', not hidden or empty."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
            or "\\" in name or "\x00" in name or len(name) > 255):
        raise UnsafeFileError(f"{where}: {what} {name!r} is not a plain name inside {where}")
    return name


def own_folder(path: Path, what: str) -> Path:
    """A folder inside a foreign checkpoint (DeepSpeed's tag directory, a universal checkpoint's
    zero/ and zero/<name>/): a directory of its own, never a symbolic link followed out (#65)."""
    if path.is_symlink() or not path.is_dir():
        raise UnsafeFileError(f"{path}: {what} is " + ("a symbolic link" if path.is_symlink()
                              else "not a folder") + "; a checkpoint's folders are its own, "
                              "never followed elsewhere (copy it with cp -rL to import its files)")
    return path


def open_data_file(path: str | Path):
    """A checkpoint's data file for reading (files.open_plain): no link followed, no FIFO waited
    on (a FIFO hung an import, #65)."""
    try:
        return open_plain(Path(path), "a checkpoint's data file", os.O_RDONLY, "rb")
    except FileError as err:
        raise UnsafeFileError(str(err)) from None


def relative_inside(name: str, root: Path, what: str) -> Path:
    """A relative path from a file (a hash table entry) as a path inside `root`, refused when it is
    absolute, climbs with '..', or passes through a symbolic link."""
    parts = Path(name).parts if isinstance(name, str) else ()
    if not parts or Path(name).is_absolute() or any(p in ("..", "") for p in parts):
        raise UnsafeFileError(f"{root}: {what} names {name!r}, which is not inside the checkpoint")
    here = root
    for part in parts[:-1]:
        here = here / part
        if here.is_symlink():
            raise UnsafeFileError(f"{root}: {what} names {name!r}, which passes through the "
                                  f"symbolic link {here}")
    return root.joinpath(*parts)
