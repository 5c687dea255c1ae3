"""Skewed-length documents for `polyshard bench --data`: the same stream of documents fed as padded rows
(one document per row, padded to seq: what an SFT collator does) or as packed rows (whole documents
side by side, polyshard's `pack_to=seq`). Compare the two runs' target tokens per second:

    polyshard bench configs/demo.yaml --backends fsdp2 --seq 512 --data skewed_docs:padded
    polyshard bench configs/demo.yaml --backends fsdp2 --seq 512 --data skewed_docs:packed

(run from benchmarks/, or with it on PYTHONPATH). Lengths are log-normal, median seq / 8, capped at
seq: most documents are short and a few fill a row, as in chat/SFT sets.
"""

from __future__ import annotations

import itertools

import torch


def documents(seq: int, seed: int, vocab_size: int):
    """An endless stream of token-id lists, 2 to seq long, median about seq / 8."""
    g = torch.Generator().manual_seed(seed)
    while True:
        length = int(torch.empty(1).log_normal_(0.0, 1.0, generator=g).item() * seq / 8)
        length = max(2, min(seq, length))
        yield torch.randint(0, vocab_size, (length,), generator=g).tolist()


def padded(rows: int, seq: int, steps: int, seed: int, vocab_size: int):
    """One document per row, right-padded: attention mask 0 and label -100 on the padding."""
    docs = documents(seq, seed, vocab_size)
    for _ in range(steps):
        ids = torch.zeros(rows, seq, dtype=torch.long)
        mask = torch.zeros(rows, seq, dtype=torch.long)
        for r, doc in zip(range(rows), docs):
            ids[r, :len(doc)], mask[r, :len(doc)] = torch.tensor(doc), 1
        yield {"input_ids": ids, "attention_mask": mask,
               "labels": torch.where(mask.bool(), ids, -100)}


def packed(rows: int, seq: int, steps: int, seed: int, vocab_size: int,
           attention: str = "eager", precision: str = "fp32"):
    """The same documents packed whole into rows of seq tokens (parallel/engine/data/packing.py):
    positions restart per document, attention confined to each (the demo Llama's eager attention:
    an additive block-diagonal mask), no target across a boundary."""
    from parallel.engine.data import packing

    docs = itertools.islice(documents(seq, seed, vocab_size), rows * steps * 16)
    packer = packing.Packer(seq, 0, lambda line: None).stream(
        [{"input_ids": d} for d in docs])
    collate = packing.collate(packing.mask_mode(attention, precision))
    stream = iter(packer)
    for _ in range(steps):
        yield collate([next(stream) for _ in range(rows)])
