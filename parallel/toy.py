"""A small, download-free job: byte-level text and a Llama-style model built from a config.

Shared by the demo, the tests and `polyshard bench`, so all of them train the same thing.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

CORPUS = Path(__file__).resolve().parent.parent / "examples" / "data" / "corpus.txt"


class ByteDataset(Dataset):
    """Non-overlapping windows of `seq_len` bytes; labels are the inputs (the model shifts them)."""

    def __init__(self, text: bytes | None = None, seq_len: int = 128):
        data = text if text is not None else CORPUS.read_bytes()
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        n = len(tokens) // seq_len
        self.blocks = tokens[: n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


SIZES = CORPUS.parent / "toy_models.json"  # shared with benchmarks/common.py


def llama_config(size: str = "demo", **overrides):
    """`demo`: ~3.2M parameters; `tiny`: ~0.1M, for tests (sizes: examples/data/toy_models.json)."""
    import json

    from transformers import LlamaConfig

    sizes = json.loads(SIZES.read_text())
    return LlamaConfig(**{**sizes["common"], **sizes[size], **overrides})


def build_llama(config):
    """A fresh LlamaForCausalLM in fp32 (the seed decides the weights)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(config).float()


def build_model(source: str):
    """toy:demo / toy:tiny, or a Hugging Face config.json (random weights from the current seed)."""
    if source.startswith("toy:"):
        return build_llama(llama_config(source[4:]))
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source),
                                            torch_dtype=torch.float32)
