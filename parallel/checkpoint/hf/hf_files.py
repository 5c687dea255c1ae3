"""The Hugging Face side of an export: weights read from a checkpoint's DCP state and written as
safetensors shards with their index, config.json and generation config (export.py decides what is
exported; `ckpt export --to hf`, and save_pretrained where it stages a checkpoint (a PEFT run's
adapter, XLA), write through `write_hf`; every other save_pretrained writes each rank's pieces in
place: hf_gather.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

import torch

from parallel.checkpoint.format.directory import partial_path, remove_ours
from parallel.checkpoint.state.portable import open_state, read_tensors, tensor_shapes
from parallel.checkpoint.state.streamed import in_parts
from parallel.files import write_atomic


MAX_SHARD_BYTES = 5_000_000_000  # save_pretrained's default max_shard_size, "5GB"
DTYPES = MappingProxyType({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16})
HF_DTYPE = MappingProxyType({torch.float32: "float32", torch.bfloat16: "bfloat16",
                             torch.float16: "float16"})


class ExportError(RuntimeError):
    """A checkpoint that cannot be exported as asked; says what to pass instead."""


Weights = list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]  # HF name, shape, reader


def write_hf(weights: Weights, cfg: dict, dtype_name: str, out: Path,
             max_shard_bytes: int | None = MAX_SHARD_BYTES, part: tuple[int, int] = (0, 1),
             durable: bool = False) -> None:
    """The weight files of `part` (i, n), and for part 0 the index, config.json and generation
    config; `durable`: each file fsynced (checkpoint.hf_at_end publishes the directory after).
    `max_shard_bytes` None: the weights split over the n parts (every process writes about one
    file's share), at most save_pretrained's 5 GB a file."""
    dtype = weight_dtype(dtype_name)
    out.mkdir(parents=True, exist_ok=True)
    _write_shards(out, weights, dtype, max_shard_bytes, part, durable)
    if not part[0]:
        write_configs(cfg, dtype, out)


def weight_dtype(dtype_name: str) -> torch.dtype:
    if dtype_name not in DTYPES:
        raise ExportError(f"--dtype {dtype_name!r}: one of {', '.join(DTYPES)}")
    return DTYPES[dtype_name]


def write_configs(cfg: dict, dtype: torch.dtype, out: Path) -> None:
    """config.json with the weights' dtype, and the generation config of a model that generates."""
    cfg["dtype"] = cfg["torch_dtype"] = HF_DTYPE[dtype]  # 4.57 reads dtype; older torch_dtype
    write_atomic(out / "config.json", json.dumps(cfg, indent=2).encode())
    _generation_config(cfg, out)


def plain_weights(path: Path, cfg: dict) -> Weights:
    reader = open_state(path)
    shapes = tensor_shapes(path, "model.", reader)
    tied = cfg.get("tie_word_embeddings") and "lm_head.weight" in shapes
    return [(name, tuple(shape), Reading(path, f"model.{name}", shape, dt, reader))
            for name, (shape, dt) in shapes.items() if not (tied and name == "lm_head.weight")]


class Reading:
    """One stored tensor, read when called; _write_shards reads a shard's plain tensors in one DCP
    read (a DCP load plans per call: one per tensor cost 3x a save of the weights)."""

    def __init__(self, path: Path, key: str, shape, dtype, reader):
        self.path, self.key, self.wanted, self.reader = path, key, (tuple(shape), dtype), reader

    def __call__(self) -> torch.Tensor:
        return read_tensors(self.path, {self.key: self.wanted}, self.reader)[self.key]


def _read_shard(shard: list) -> dict[str, torch.Tensor]:
    """A shard's tensors: the plain ones of one checkpoint in one read, merged ones one by one."""
    plain = [(name, read) for name, _, read in shard if isinstance(read, Reading)]
    got = {}
    if plain:
        first = plain[0][1]
        values = read_tensors(first.path, {r.key: r.wanted for _, r in plain}, first.reader)
        got = {name: values[r.key] for name, r in plain}
    return {name: got[name] if name in got else read() for name, _, read in shard}


def _plan(weights: Weights, size: int, max_bytes: int | None, parts: int) -> list[list]:
    """The weights in file order, cut where a file would pass `max_bytes` (save_pretrained's rule);
    `max_bytes` None: cut into `parts` files of about equal bytes (each tensor in the file its
    middle byte falls in), then by save_pretrained's 5 GB where a file passes it."""
    if max_bytes is None:
        total, start = sum(size * _numel(shape) for _, shape, _ in weights) or 1, 0
        spread: list[list] = [[] for _ in range(parts)]
        for entry in weights:
            nbytes = size * _numel(entry[1])
            spread[min(parts - 1, (start + nbytes // 2) * parts // total)].append(entry)
            start += nbytes
        return [cut for shard in spread if shard
                for cut in _plan(shard, size, MAX_SHARD_BYTES, 1)]
    return in_parts(list(weights), lambda entry: size * _numel(entry[1]), max_bytes)


def shard_files(weights: Weights, size: int, max_bytes: int | None, parts: int
                ) -> list[tuple[str, list]]:
    """(file name, its weights) in file order, as _plan cuts them."""
    shards = _plan(weights, size, max_bytes, parts)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                                   for i in range(n)]
    return list(zip(names, shards))


def write_index(out: Path, files: list[tuple[str, list]], size: int) -> None:
    """model.safetensors.index.json, for weights in more than one file."""
    if len(files) > 1:
        weights = [entry for _, shard in files for entry in shard]
        index = {"metadata": {"total_size": sum(size * _numel(s) for _, s, _ in weights)},
                 "weight_map": {name: file for file, shard in files for name, _, _ in shard}}
        write_atomic(out / "model.safetensors.index.json", json.dumps(index, indent=2).encode())


def _write_shards(out: Path, weights: Weights, dtype: torch.dtype, max_bytes: int | None,
                  part: tuple[int, int] = (0, 1), durable: bool = False) -> None:
    """Shards planned from the shapes, then written one at a time (memory: one shard); `part` (i, n)
    writes shards i, i + n, ... and part 0 the index."""
    size = dtype.itemsize
    files = shard_files(weights, size, max_bytes, part[1])
    mine, parts = part
    for i, (file_name, shard) in enumerate(files):
        if i % parts == mine:
            tensors = {name: t.to(dtype) for name, t in sorted(_read_shard(shard).items())}
            write_safetensors(out / file_name, tensors, durable)
            del tensors
    if mine == 0:
        write_index(out, files, size)


SAFETENSORS_DTYPE = MappingProxyType({torch.float32: "F32", torch.bfloat16: "BF16",
                                      torch.float16: "F16"})


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], durable: bool = False) -> None:
    """A safetensors file of `tensors`, laid out in the dict's order."""
    file = SafetensorsFile(path, [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()])
    try:
        for t in tensors.values():
            file.write(t)
    except BaseException:
        file.abandon()
        raise
    file.close(durable)


def safetensors_layout(layout: list[tuple[str, tuple, torch.dtype]]) -> tuple[bytes, dict, int]:
    """A safetensors file's first bytes (length and header) for `layout` (name, shape, dtype; its
    order is the file's), where each tensor's bytes start in the file, and the file's length. The
    same on every rank: save_pretrained's ranks write into a file another rank made (hf_gather)."""
    header, start = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in layout:
        nbytes = _numel(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPE[dtype], "shape": list(shape),
                        "data_offsets": [start, start + nbytes]}
        start += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data 8-byte aligned, as safetensors pads it
    base = 8 + len(head)
    places = {name: base + header[name]["data_offsets"][0] for name, _, _ in layout}
    return len(head).to_bytes(8, "little") + head, places, base + start


class SafetensorsFile:
    """A safetensors file written front to back: the header from `layout` (name, shape, dtype; its
    order is the file's), then each tensor's bytes, in that order, from the tensor's own memory.
    safetensors' save_file first copies every tensor into a Python bytes object (the whole file
    once more in memory, and its time); its reader (safe_open, from_pretrained) is this writer's
    oracle in the tests. Written beside `path` and renamed over it at `close`: a planted link is
    replaced, never written through. `allocate` gives it its whole length at once, for writers
    that place each tensor's bytes themselves (hf_gather)."""

    def __init__(self, path: Path, layout: list[tuple[str, tuple, torch.dtype]]):
        head, _, self.length = safetensors_layout(layout)
        self.path, self.tmp = path, partial_path(path)
        remove_ours(self.tmp)
        self.file = open(self.tmp, "xb")  # exclusive: never through a link planted since
        self.file.write(head)

    def write(self, t: torch.Tensor) -> None:
        self.file.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                                   .numpy()))

    def allocate(self) -> None:
        """The file at its full length (the data a hole until written), before the header is on
        the disk: every rank may then write its pieces at their places."""
        self.file.flush()
        os.ftruncate(self.file.fileno(), self.length)

    def close(self, durable: bool) -> None:
        """`durable`: fsynced before the rename."""
        self.file.flush()
        if durable:
            os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)

    def abandon(self) -> None:
        self.file.close()
        remove_ours(self.tmp)


def model_class(cfg: dict):
    """The transformers model class a config's `architectures` names, or None: only a
    PreTrainedModel subclass counts (an export whose architectures named a function, `pipeline`,
    called it: a traceback, #65), looked up by an identifier, never anything else."""
    import transformers

    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    cls = getattr(transformers, arch, None) if arch and arch.isidentifier() else None
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) else None


def _generation_config(cfg: dict, out: Path) -> None:
    cls = model_class(cfg)
    if cls is not None and cls.can_generate():
        from transformers import GenerationConfig, PretrainedConfig

        generation = GenerationConfig.from_model_config(PretrainedConfig.from_dict(cfg))
        # what its save_pretrained writes (to_json_file, use_diff), never through a planted link
        write_atomic(out / "generation_config.json", generation.to_json_string(use_diff=True).encode())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
