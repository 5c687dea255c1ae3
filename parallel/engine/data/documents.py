"""One tokenized document as packing takes it (engine.dataloader(pack_to=N), packing.py): its token
ids and labels, each a whole number in the model's vocabulary (labels also -100), checked as each
document is read and named by its index, so a hostile or malformed dataset is an error naming the
document and field, never a traceback or a silently wrong row."""

from __future__ import annotations

import torch

from parallel.kits.objective import IGNORE_INDEX


def document(item, index: int | str = "?", vocab: int | None = None
             ) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one document: a dict with input_ids (and labels, e.g. an SFT prompt
    masked with -100), or a sequence of token ids. Every id a whole number in the vocabulary
    (labels also -100), checked here and named by the document's index: strings, None, nested
    lists, floats (truncated silently before), 2**70 or ids past the vocabulary were a traceback
    or a wrong row (#65)."""
    if isinstance(item, dict):
        if "input_ids" not in item:
            raise ValueError(f"engine.dataloader(pack_to=...): document {index} has no input_ids "
                             f"(keys {sorted(map(str, item))[:8]})")
        ids, labels = item["input_ids"], item.get("labels", item["input_ids"])
    else:
        ids = labels = item
    ids, labels = _ints(ids, index, "input_ids", vocab), _ints(labels, index, "labels", vocab)
    if len(ids) != len(labels) or not ids:
        raise ValueError(f"engine.dataloader(pack_to=...): document {index} has {len(ids)} "
                         f"input_ids and {len(labels)} labels; each needs at least one token and "
                         "as many labels as tokens")
    return ids, labels


def _ints(values, index, field: str, vocab: int | None) -> list[int]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype.is_floating_point or values.dtype == torch.bool:
            return _refuse(index, field, f"a {values.dtype} tensor of shape {tuple(values.shape)}")
        values = values.tolist()
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        return _refuse(index, field, f"{type(values).__name__} {str(values)[:40]!r}")
    out = list(values)
    low = IGNORE_INDEX if field == "labels" else 0
    for v in out:
        if not isinstance(v, int) or isinstance(v, bool):
            return _refuse(index, field, f"holds {type(v).__name__} {str(v)[:40]!r}")
        if not (v == low or 0 <= v < (vocab or 1 << 62)):
            return _refuse(index, field, f"holds {v}, outside the vocabulary (0 to "
                           f"{(vocab or 1 << 62) - 1}" + (", or -100" if low else "") + ")")
    return out


def _refuse(index, field: str, what: str):
    raise ValueError(f"engine.dataloader(pack_to=...): document {index}'s {field} {what}; token "
                     "ids are whole numbers in the model's vocabulary (labels also -100)")


def vocab_of(model) -> int | None:
    """The vocabulary size of the Hugging Face model under any wrapper, None where it has none."""
    from parallel.kits.objective import base_model

    for _ in range(4):  # DeepSpeed's engine, FSDP1 and XLA FSDP hold it as .module
        model = getattr(model, "module", model)
    vocab = getattr(getattr(base_model(model), "config", None), "vocab_size", None)
    return vocab if isinstance(vocab, int) and vocab > 0 else None
