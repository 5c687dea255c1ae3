"""The one reader of files inside a checkpoint (docs/security.md): a file is read only when the hash
table of the rank that wrote it lists it (rank 0: the trainer state, shared user state and the
model's configs; rank r: its RNG and per-rank user state), it lies inside the checkpoint with no
symbolic link on its way (opened with O_NOFOLLOW), is a regular file of the size the table records
and within a cap, and what it holds is parsed as data into a schema (schemas.py): a violation names
the file and the field, and the CLI exits 2.

Every loader of these files goes through `Contents`: engine.load (trainer.pt, rng/, user/) and the
Hugging Face exports (hf_config.json, peft_config.json)."""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path

from parallel.checkpoint.format.manifest import HASHES, MANIFEST, typed_table
from parallel.checkpoint.format.schemas import parse
from parallel.checkpoint.format.safe import (
    TABLE_LIMIT,
    UnsafeFileError,
    load_json,
    relative_inside,
    torch_load,
)
from parallel.files import check_depth

SMALL_LIMIT = 1 << 30  # a trainer state, RNG state, user state or config: small files, capped


class Contents:
    """The files of one checkpoint, as its writers listed them. `manifest`: read_manifest's (or
    Verification's) manifest of `path`."""

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = Path(path), manifest
        self._tables: dict[int, dict] = {}

    def table(self, writer: int) -> dict:
        """{file: {size, digest}} of writer rank `writer` (format 1: the manifest's one table)."""
        if writer not in self._tables:
            if self.manifest["format_version"] == 1:
                self._tables[writer] = typed_table(self.manifest["files"], self.path / MANIFEST)
            else:
                file = self.path / HASHES / f"rank{writer}.json"
                if not 0 <= writer < self.manifest.get("writers", 1):
                    self._tables[writer] = {}
                else:
                    self._tables[writer] = typed_table(
                        load_json(file, "a hash table", TABLE_LIMIT, follow=False), file)
        return self._tables[writer]

    def has(self, name: str, writer: int = 0) -> bool:
        return name in self.table(writer)

    def read_bytes(self, name: str, writer: int, what: str, limit: int = SMALL_LIMIT) -> bytes:
        """The file's bytes, once it is listed, inside, not a link, regular and of its listed size."""
        table = self.table(writer)
        source = (self.path / MANIFEST if self.manifest["format_version"] == 1
                  else self.path / HASHES / f"rank{writer}.json")
        if name not in table:
            raise UnsafeFileError(f"{self.path / name}: not listed in {source.relative_to(self.path)}"
                                  f" ({what}); polyshard reads only the files a checkpoint's "
                                  "writers recorded")
        file = relative_inside(name, self.path, f"{source.name}'s entry")
        size = table[name]["size"]
        try:
            fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
        except OSError as err:
            raise UnsafeFileError(f"{file}: cannot be opened as a file of its own ({what}: "
                                  f"{err.strerror}; a symbolic link is refused)") from None
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise UnsafeFileError(f"{file}: not a regular file ({what})")
            if info.st_size != size or size > limit:
                raise UnsafeFileError(f"{file}: {info.st_size:,} bytes where "
                                      f"{source.name} lists {size:,} (at most {limit:,}; {what})")
            data = f.read(size + 1)
        if len(data) != size:
            raise UnsafeFileError(f"{file}: changed while read ({what})")
        return data

    def load(self, name: str, writer: int, what: str, schema=None, allow: tuple = (),
             trust: bool = False):
        """A torch.save'd file as data (weights_only, plus `allow`), checked against `schema`."""
        data = self.read_bytes(name, writer, what)
        obj = torch_load(_Named(data, self.path / name), what, allow, trust)
        return obj if schema is None else parse(schema, obj, self.path / name, what)

    def load_json(self, name: str, what: str, schema=None, writer: int = 0):
        """A JSON file of the checkpoint as data, or None when the checkpoint has none."""
        if not self.has(name, writer):
            return None
        file = self.path / name
        try:
            data = json.loads(self.read_bytes(name, writer, what).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise UnsafeFileError(f"{file}: not valid JSON ({what}: {err})") from None
        check_depth(data, file, what)
        return data if schema is None else parse(schema, data, file, what)


class _Named(io.BytesIO):
    """Bytes that name their file in torch_load's messages."""

    def __init__(self, data: bytes, file: Path):
        super().__init__(data)
        self.name = str(file)
