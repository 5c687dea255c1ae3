"""Document packing: variable-length tokenized documents as full rows of N tokens, each document
whole (one longer than N is cut to N, said once), its positions restarting at 0, its attention
confined to itself and its first token never a target of the document before it, so a packed row's
loss and gradients are those of its documents run one by one (tests/unit/test_packing.py: 1e-6).

Why our own packer: TRL's `pack_dataset` works on Hugging Face Datasets only and is not one of our
dependencies; this one takes any map-style dataset (best-fit decreasing over the lengths, planned
once: the rows are then a map-style dataset, so the sampler's saved position resumes exactly) and
any stream, torch's or Hugging Face's (next-fit in stream order after the per-rank split; the one
document read ahead is saved with the stream's own position, so a resume is exact too).

How attention is confined depends on the model's attention implementation (`mask_mode`): a 4-D
block-diagonal causal mask, boolean for sdpa, additive in the compute dtype for eager (which adds
the mask to its scores: a boolean one is silently wrong, measured 0.2 off); flash attention takes
the documents' bounds from the restarting position ids alone (transformers' varlen path), so no
N x N mask is built. A row's N x N mask costs N^2 bytes: at 32k tokens use flash attention.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Dataset, IterableDataset

from parallel.kits.objective import IGNORE_INDEX
from parallel.engine.data.documents import document, vocab_of  # noqa: F401 - vocab_of: the engine's

FLASH = ("flash_attention_2", "flash_attention_3")


def attention_of(model) -> str | None:
    """The Hugging Face model's attention implementation (a PEFT model's base's), read before any
    backend wraps it."""
    from parallel.kits.objective import base_model

    return getattr(getattr(base_model(model), "config", None), "_attn_implementation", None)


def confines_flattened(model) -> bool:
    """Whether the model confines attention to each document of a flattened row (documents side by
    side, position ids restarting at 0, no attention mask: transformers' DataCollatorWithFlattening)
    by itself: flash attention reads the bounds from the position ids; sdpa, eager and flex do where
    the model builds its mask with transformers' masking_utils (it finds the restarts when no
    attention mask and no cache is given; the engine's forwards pass use_cache=False). Models with
    their own mask code (Qwen2-MoE, OPT, ... in transformers 4.57) attend across documents."""
    import sys

    from parallel.kits.objective import base_model

    impl = attention_of(model)
    module = sys.modules.get(type(base_model(model)).__module__)
    return impl in FLASH or hasattr(module, "create_causal_mask")


def flattened_problem(batch) -> str | None:
    """A flattened batch (position ids restarting inside a row, no attention mask) named with the
    fix, for a model that would let its documents attend to each other."""
    if not isinstance(batch, dict) or batch.get("attention_mask") is not None:
        return None
    positions = batch.get("position_ids")
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[1] < 2:
        return None
    restarts = int((positions[:, 1:] != positions[:, :-1] + 1).sum())
    if not restarts:
        return None
    return (f"the batch holds documents side by side ({restarts} position-id restarts, no attention "
            "mask: DataCollatorWithFlattening's format), and this model's attention does not "
            "confine them, so each document would attend to the ones before it; use "
            "engine.dataloader(dataset, pack_to=N) (polyshard's packing makes each row's mask) or "
            "build the model with attn_implementation='flash_attention_2'")


def mask_mode(impl: str | None, precision: str, rows: int = 1, n: int = 0, device=None) -> str:
    """'positions' (flash attention: no mask), 'bool' (sdpa) or an additive mask's dtype name;
    with `rows` rows of `n` tokens a batch, refused where the batch's N x N masks alone exceed
    the memory of `device` (a CUDA device's, else the host's): pack_to=1<<24 asked for 256 TiB a
    row and died allocating it (#65)."""
    if impl in FLASH:
        return "positions"
    if impl == "sdpa":
        _check_masks(rows, n, 1, device)
        return "bool"
    if impl == "eager":
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]
        _check_masks(rows, n, getattr(torch, dtype).itemsize, device)
        return dtype
    raise ValueError(f"engine.dataloader(pack_to=...): the model's attention implementation is "
                     f"{impl!r}; packing confines attention to each document with eager, sdpa or "
                     "flash_attention_2/3 (attn_implementation= when the model is built)")


def _check_masks(rows: int, n: int, itemsize: int, device) -> None:
    need = rows * n * n * itemsize
    if device is not None and getattr(device, "type", None) == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, "the GPU's memory"
    else:
        import psutil

        have, where = psutil.virtual_memory().total, "this host's memory"
    if need > have:
        raise ValueError(f"engine.dataloader(pack_to={n:,}): each batch's {rows} packed row(s) need "
                         f"N x N attention masks of {need / 2**30:,.1f} GiB, beyond {where} "
                         f"({have / 2**30:,.1f} GiB); build the model with "
                         "attn_implementation='flash_attention_2' (no mask: documents bounded by "
                         "their positions) or pick a smaller pack_to")


def make_row(docs: list[tuple[list[int], list[int]]], n: int, pad_id: int) -> dict:
    """One packed row: documents side by side, their first token never a target (the previous
    document's last token would predict it), then padding that is neither a target nor attended."""
    ids, labels, positions, segment = [], [], [], []
    for d, (doc_ids, doc_labels) in enumerate(docs):
        ids += doc_ids
        labels += [IGNORE_INDEX] + doc_labels[1:]
        positions += range(len(doc_ids))
        segment += [d] * len(doc_ids)
    pad = n - len(ids)
    return {"input_ids": torch.tensor(ids + [pad_id] * pad),
            "labels": torch.tensor(labels + [IGNORE_INDEX] * pad),
            "position_ids": torch.tensor(positions + list(range(pad))),
            "segment": torch.tensor(segment + [-1] * pad)}  # padding: a segment of its own


def collate(mode: str) -> Callable[[list[dict]], dict]:
    """Stacks packed rows and builds the mask `mode` asks for (a module-level function's partial:
    picklable for loader workers)."""
    return functools.partial(_collate, mode=mode)


def _collate(rows: list[dict], mode: str) -> dict:
    batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels", "position_ids")}
    if mode == "positions":
        return batch
    segment = torch.stack([r["segment"] for r in rows])
    n = segment.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    allowed = (segment[:, :, None] == segment[:, None, :]) & causal
    if mode != "bool":  # additive, in the compute dtype: 0 where attended, the dtype's min elsewhere
        dtype = getattr(torch, mode)
        zero = torch.zeros((), dtype=dtype)
        allowed = torch.where(allowed, zero, torch.finfo(dtype).min)
    batch["attention_mask"] = allowed[:, None]
    return batch


def plan_rows(lengths: list[int], n: int) -> list[list[int]]:
    """Best-fit decreasing: each document (longest first) into the fullest row it fits, in
    O(docs log n): a tree over the free space of rows finds the smallest free space >= a length."""
    order = sorted(range(len(lengths)), key=lambda i: (-min(lengths[i], n), i))
    free = _FreeSpace(n)
    rows: list[list[int]] = []
    by_space: dict[int, list[int]] = {}  # free space -> rows with exactly that much free
    for i in order:
        size = min(lengths[i], n)
        space = free.smallest_at_least(size)
        if space is None:
            rows.append([])
            row = len(rows) - 1
        else:
            row = by_space[space].pop()
            free.remove(space)
        rows[row].append(i)
        left = (space if space is not None else n) - size
        by_space.setdefault(left, []).append(row)
        free.add(left)
    return rows


class _FreeSpace:
    """Counts of rows by free space 0..n, with 'smallest free space >= x' in O(log n)."""

    def __init__(self, n: int):
        self.size = 1
        while self.size < n + 1:
            self.size *= 2
        self.count = [0] * (2 * self.size)

    def add(self, space: int, by: int = 1) -> None:
        i = space + self.size
        while i:
            self.count[i] += by
            i //= 2

    def remove(self, space: int) -> None:
        self.add(space, -1)

    def smallest_at_least(self, x: int) -> int | None:
        return self._find(1, 0, self.size, x)

    def _find(self, node: int, lo: int, hi: int, x: int) -> int | None:
        if hi <= x or self.count[node] == 0:
            return None
        if hi - lo == 1:
            return lo
        mid = (lo + hi) // 2
        found = self._find(2 * node, lo, mid, x)
        return found if found is not None else self._find(2 * node + 1, mid, hi, x)


class Packer:
    """What engine.dataloader(pack_to=N) hands the loader: documents as rows of N tokens."""

    def __init__(self, n: int, pad_id: int, say: Callable[[str], None], vocab: int | None = None):
        self.n, self.pad_id, self.say, self.vocab = n, pad_id, say, vocab

    def rows(self, docs) -> PackedRows:
        """A map-style dataset of documents, planned once."""
        return PackedRows(docs, self.n, self.pad_id, self.say, self.vocab)

    def stream(self, share) -> PackedStream:
        """This rank's share of a stream of documents, packed as it is read."""
        return PackedStream(share, self.n, self.pad_id, self.say, self.vocab)


class PackedRows(Dataset):
    """A map-style dataset of documents as packed rows, planned once over their lengths."""

    def __init__(self, docs, n: int, pad_id: int, say: Callable[[str], None],
                 vocab: int | None = None):
        self.docs, self.n, self.pad_id, self.vocab = docs, n, pad_id, vocab
        lengths = [len(document(docs[i], i, vocab)[0]) for i in range(len(docs))]
        self.rows = plan_rows(lengths, n)
        cut = [x for x in lengths if x > n]
        if cut:
            say(f"pack_to {n}: {len(cut)} of {len(lengths)} documents are longer and were cut to "
                f"{n} tokens (the longest: {max(cut)})")
        self.fill = sum(min(x, n) for x in lengths) / (len(self.rows) * n) if self.rows else 0.0
        inner = getattr(docs, "_fingerprint", None)  # a Hugging Face dataset's
        self._fingerprint = (f"packed to {n}: {len(self.rows)} rows of {len(lengths)} documents"
                             + (f" of {inner}" if isinstance(inner, str) else ""))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        docs = [document(self.docs[j], j, self.vocab) for j in self.rows[i]]
        return make_row([(ids[:self.n], labels[:self.n]) for ids, labels in docs], self.n,
                        self.pad_id)


class PackedStream(IterableDataset):
    """A stream of documents (this rank's share) as packed rows, next-fit in stream order. Its
    position: the share's own (Hugging Face) or documents read (torch), and the document read ahead
    that starts the next row."""

    def __init__(self, share, n: int, pad_id: int, say: Callable[[str], None],
                 vocab: int | None = None):
        self.share, self.n, self.pad_id, self.say, self.vocab = share, n, pad_id, say, vocab
        self.read, self.carry, self.told = 0, None, False

    def __iter__(self) -> Iterator[dict]:
        row, used = [], 0
        if self.carry is not None:
            row, used, self.carry = [self.carry], len(self.carry[0]), None
        for item in self.share:
            self.read += 1
            ids, labels = document(item, f"{self.read} of this rank's stream", self.vocab)
            if len(ids) > self.n:
                self._tell(len(ids))
                ids, labels = ids[:self.n], labels[:self.n]
            if used + len(ids) > self.n:
                self.carry = (ids, labels)  # read ahead: the next row's first document
                yield make_row(row, self.n, self.pad_id)
                row, used, self.carry = [(ids, labels)], len(ids), None
                continue
            row.append((ids, labels))
            used += len(ids)
        if row:
            yield make_row(row, self.n, self.pad_id)
        self.read = 0

    def _tell(self, length: int) -> None:
        if not self.told:
            self.told = True
            self.say(f"pack_to {self.n}: a document of {length} tokens was cut to {self.n} (said "
                     "once; later ones are cut alike)")

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.share, "set_epoch"):
            self.share.set_epoch(epoch)
        if hasattr(self.share, "skip"):
            self.share.skip = 0

    def state_dict(self) -> dict:
        own = self.share.state_dict() if hasattr(self.share, "state_dict") else None
        return {"share": own, "read": self.read, "carry": self.carry}

    def load_state_dict(self, state: dict) -> None:
        if state["share"] is not None and hasattr(self.share, "load_state_dict"):
            self.share.load_state_dict(state["share"])
        elif hasattr(self.share, "skip"):  # a torch stream's share: skip what was read
            self.share.skip = state["read"]
        self.read = state["read"]
        carry = state["carry"]
        self.carry = None if carry is None else (list(carry[0]), list(carry[1]))

