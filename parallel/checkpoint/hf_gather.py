"""save_pretrained without a staging copy: each rank's pieces of the model go straight to the rank
that writes the safetensors file they belong to, and land where they sit in that file.

The pieces are what DCP would write of the backend's portable state (portable.save_state through a
`Sink` with `capture`): `Capture` is a DCP storage writer that keeps each write item's tensor instead
of writing it. So every backend's layout (DTensor shards, ZeRO and XLA flat ranges, tensor-parallel
blocks) arrives the one way, and DCP's own plan says which rank sends what: a tensor held whole by
several ranks is sent by one, every chunk exactly once.

Files are planned as write_hf plans them (hf_files.shard_files: with `max_bytes` None about one
file per rank); file i is written by rank i % N. Per round (one file per writer) every rank sends
each writer its pieces of that writer's file in one all_to_all, cast to the file's dtype; the
writer copies each piece into the file's buffer and writes it (hf_files.write_safetensors). A rank
sends O(model / N) and holds O(one file); the shapes come from rank 0 (O(tensors), not O(N)).

The staging path (save_pretrained's other branch: the model's shards written to a DCP directory
in the page cache, read back per file) measured 1.6x a DCP save of the same weights; this one
reads nothing back (docs/bench.md).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter
from torch.futures import Future

from parallel.checkpoint.hf_files import SafetensorsFile, shard_files, write_configs, write_index


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


def exchange_device(world: int) -> torch.device | None:
    """Where pieces travel: CUDA over NCCL, host memory over gloo; None for a process group with
    neither (torch_xla's): save_pretrained stages through files there."""
    if world == 1:
        return torch.device("cpu")
    backend = str(dist.get_backend())
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if "gloo" in backend else None


def write_gathered(capture: Capture, cfg: dict, dtype: torch.dtype, out: Path,
                   max_bytes: int | None, rank: int, world: int, device: torch.device,
                   durable: bool = False) -> None:
    """This rank's files of the Hugging Face save (collective), and on rank 0 the index and
    configs. `capture` holds this rank's pieces of the "model" section."""
    shapes = [capture.shapes]
    if world > 1:
        dist.broadcast_object_list(shapes, src=0)  # the coordinator's: every stored tensor
    tied = cfg.get("tie_word_embeddings") and "model.lm_head.weight" in shapes[0]
    entries = [(k[len("model."):], shape, None) for k, shape in shapes[0].items()
               if k.startswith("model.") and not (tied and k == "model.lm_head.weight")]
    size = dtype.itemsize
    files = shard_files(entries, size, max_bytes, world)
    where, rounds = _slices(files, size)
    pieces: dict[tuple[int, int], list] = {}  # (file, slice) -> this rank's pieces of it
    for key, offsets, sizes, data in capture.pieces:
        at = where.get(key[len("model."):]) if key.startswith("model.") else None
        if at is not None:
            pieces.setdefault((at[0], at[2]), []).append((at[1], offsets, sizes, data))
    ndim = max((len(shape) for _, shape, _ in entries), default=0)
    out.mkdir(parents=True, exist_ok=True)
    for first in range(0, len(files), world):  # one file per writer a round
        ours = first + rank if first + rank < len(files) else None
        file = GatheredFile(out, *files[ours], where, dtype, durable) if ours is not None else None
        try:
            for k in range(rounds):  # one slice of each file: the disk writes it while k + 1 travels
                part = file.part(k) if file else None
                sent: list[list] = [[] for _ in range(world)]
                for dest in range(min(world, len(files) - first)):
                    for piece in pieces.pop((first + dest, k), []):
                        if dest == rank:  # this rank's own file: straight into its place
                            part.land(*piece)
                        else:
                            sent[dest].append(piece)
                _exchange(sent, part, dtype, ndim, device, world)
                if file:
                    file.queue(part)
        except BaseException:
            if file:
                file.abandon()
            raise
        if file:
            file.close()
    if rank == 0:
        write_index(out, files, size)
        write_configs(cfg, dtype, out)


SLICE_BYTES = 64 << 20  # a file travels in slices of about this much, written as each lands


def _slices(files: list, size: int) -> tuple[dict[str, tuple[int, int, int]], int]:
    """name -> (file, position in its shard, slice), and the number of slices every file is cut
    into (the same for all: each is one collective exchange). A file's tensors, in its order (by
    name), go to the slice their first byte falls in."""
    totals = [size * sum(math.prod(s) for _, s, _ in shard) for _, shard in files]
    rounds = max([1, *(-(-t // SLICE_BYTES) for t in totals)])
    where = {}
    for i, (_, shard) in enumerate(files):
        start = 0
        for j in sorted(range(len(shard)), key=lambda j: shard[j][0]):
            where[shard[j][0]] = (i, j, min(rounds - 1, start * rounds // max(totals[i], 1)))
            start += size * math.prod(shard[j][1])
    return where, rounds


class GatheredFile:
    """One safetensors file this rank writes, slice by slice: the header first (the layout is
    known from the shapes), each slice's bytes once every piece of it has landed, written and
    synced by a thread of its own while the next slice is exchanged (two slices held)."""

    def __init__(self, out: Path, name: str, shard: list, where: dict, dtype: torch.dtype,
                 durable: bool):
        from concurrent.futures import ThreadPoolExecutor

        self.shard, self.dtype, self.durable = shard, dtype, durable
        self.order = sorted(range(len(shard)), key=lambda j: shard[j][0])
        self.slice_of = {j: where[shard[j][0]][2] for j in self.order}
        self.file = SafetensorsFile(out / name, [(shard[j][0], tuple(shard[j][1]), dtype)
                                                 for j in self.order])
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="polyshard-hf-write")
        self.pending: list = []

    def part(self, k: int) -> Part:
        return Part([(j, tuple(self.shard[j][1])) for j in self.order if self.slice_of[j] == k],
                    self.shard, self.dtype)

    def queue(self, part: Part) -> None:
        part.check()
        if self.pending:  # the slice before written first: two held, one written, one filled
            self.pending.pop(0).result()
        self.pending.append(self.thread.submit(self._write, part))

    def _write(self, part: Part) -> None:
        for t in part.views.values():
            self.file.write(t)
        if self.durable:
            self.file.sync()

    def close(self) -> None:
        """Every slice written, then the file fsynced (durable) and renamed into place."""
        try:
            for done in self.pending:
                done.result()
        except BaseException:
            self.abandon()
            raise
        self.thread.shutdown()
        self.file.close(self.durable)

    def abandon(self) -> None:
        """After a failure: the writes in flight end, the partial file is removed."""
        self.thread.shutdown(wait=True, cancel_futures=True)
        self.file.abandon()


class Part:
    """One slice of a file being assembled: a host buffer of its tensors in the file's order, each
    a view of it, so a piece is copied once, into its final place."""

    def __init__(self, tensors: list[tuple[int, tuple]], shard: list, dtype: torch.dtype):
        self.shard = shard
        flat = torch.empty(sum(math.prod(shape) for _, shape in tensors), dtype=dtype)
        self.views, start = {}, 0
        for j, shape in tensors:
            self.views[j] = flat[start:start + math.prod(shape)].view(shape)
            start += math.prod(shape)
        self.landed = dict.fromkeys(self.views, 0)

    def land(self, j: int, offsets: tuple, sizes: tuple, data: torch.Tensor) -> None:
        """Piece (offsets, sizes) of tensor j (its position in the file's shard)."""
        full = self.views[j]
        full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].copy_(data.view(sizes))
        self.landed[j] += math.prod(sizes)

    def check(self) -> None:
        """Every element of every tensor landed (DCP's plan covers each tensor exactly once; a
        shortfall would write uninitialised memory)."""
        for j, view in self.views.items():
            if self.landed[j] != view.numel():
                raise RuntimeError(f"save_pretrained: {self.shard[j][0]} got {self.landed[j]} of "
                                   f"its {view.numel()} elements from the ranks' pieces")


def _exchange(sent: list[list], part: Part | None, dtype: torch.dtype, ndim: int,
              device: torch.device, world: int) -> None:
    """One all_to_all of each rank's pieces for each writer (headers: the tensor's position in the
    file, offsets, sizes; payload: the pieces cast to `dtype`, packed in one copy each), then
    each received piece landed in `part`. Three collectives: counts, headers, payload."""
    if world == 1:
        return
    heads = [[v for j, off, sz, _ in pieces for v in (j, *_pad(off, ndim), *_pad(sz, ndim))]
             for pieces in sent]
    numel = [sum(math.prod(sz) for _, _, sz, _ in pieces) for pieces in sent]
    counts = torch.tensor([[len(h), n] for h, n in zip(heads, numel)], dtype=torch.int64,
                          device=device)
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts)
    got = got.tolist()
    head_in = torch.empty(sum(h for h, _ in got), dtype=torch.int64, device=device)
    flat_heads = torch.tensor([v for h in heads for v in h], dtype=torch.int64, device=device)
    dist.all_to_all_single(head_in, flat_heads, [h for h, _ in got], [len(h) for h in heads])
    payload, start = torch.empty(sum(numel), dtype=dtype, device=device), 0
    for pieces in sent:
        for _, _, sz, data in pieces:
            payload[start:start + math.prod(sz)].copy_(data.reshape(-1))
            start += math.prod(sz)
    received = torch.empty(sum(n for _, n in got), dtype=dtype, device=device)
    dist.all_to_all_single(received, payload, [n for _, n in got], numel)
    start = 0
    for j, *rest in head_in.view(-1, 1 + 2 * ndim).tolist():
        dims = part.views[j].dim()
        sizes = tuple(rest[ndim:ndim + dims])
        part.land(j, tuple(rest[:dims]), sizes, received[start:start + math.prod(sizes)])
        start += math.prod(sizes)


def _pad(values: tuple, ndim: int) -> list[int]:
    """A chunk's offsets or sizes as `ndim` numbers (a header row has one width)."""
    return [*values, *[0] * (ndim - len(values))]
