"""A malformed batch fails its step with a clear error, paid for with nothing the step does not do
already (docs/reliability.md, "What a step pays"): it is checked on its own rank, before any
collective of the step; that rank raises BatchError and exits, and the launcher ends the job
(torchrun's agent; `srun --kill-on-bad-exit` in the emitted Slurm script). Its peers need no
collective to learn of it."""

from __future__ import annotations

from collections.abc import Mapping

import torch


class BatchError(ValueError):
    """This rank's batch cannot be trained on; raised on that rank before any collective."""



def batch_problem(batch, signature: dict | None, rows_expected: int) -> tuple[str | None, dict]:
    """Why this rank's batch is unusable (None when fine), and its signature (keys, dtypes, ranks
    of the tensors) that later batches are held to."""
    if isinstance(batch, Mapping):
        items = list(batch.items())
    elif isinstance(batch, (list, tuple)):
        items = list(enumerate(batch))
    else:
        return (f"a batch must be a mapping (dict, BatchEncoding) or tuple of tensors, not "
                f"{type(batch).__name__}"), {}
    if not items:
        return "the batch has no entries", {}
    bad = [str(k) for k, v in items if not isinstance(v, torch.Tensor)]
    if bad:
        return non_tensor_fix(bad), {}
    mine = {str(k): (str(v.dtype), v.dim()) for k, v in items}
    if signature is not None and mine != signature:
        missing = sorted(set(signature) - set(mine))
        changed = sorted(k for k in set(signature) & set(mine) if signature[k] != mine[k])
        changes = [(k, signature[k], mine[k]) for k in changed]
        return (f"keys/dtypes differ from the first batch: missing {missing}, extra "
                f"{sorted(set(mine) - set(signature))}, changed {changes}"), mine
    sizes = {str(k): (v.shape[0] if v.dim() else 0) for k, v in items}
    if any(s == 0 for s in sizes.values()):
        return f"empty batch (rows per entry: {sizes})", mine
    if len(set(sizes.values())) > 1:
        return f"entries disagree on the batch dimension: {sizes}", mine
    if next(iter(sizes.values())) != rows_expected:
        return (f"{next(iter(sizes.values()))} samples, the spec's step takes {rows_expected} per "
                "rank (micro_batch_size x grad_accum_steps x devices per process)"), mine
    return None, mine


def non_tensor_fix(bad: list[str]) -> str:
    return (f"entries {bad} are not tensors (text columns reach the batch when a dataset keeps "
            "them): drop them (dataset.remove_columns(" + repr(bad) + ") or a collate_fn that "
            "returns tensors only), or give the dataset the torch format "
            "(dataset.with_format('torch', columns=[...]))")


def check_pack_args(pack_to, collate_fn) -> None:
    """engine.dataloader(pack_to=...)'s arguments, refused naming the fix."""
    if collate_fn is not None:
        raise ValueError("engine.dataloader: pack_to and collate_fn together: packing builds "
                         "the rows and their masks itself; pass tokenized documents (dicts "
                         "with input_ids, and labels if some tokens are not targets) without "
                         "a collate_fn")
    if isinstance(pack_to, bool) or not isinstance(pack_to, int) or not 2 <= pack_to <= 1 << 24:
        raise ValueError(f"engine.dataloader: pack_to={pack_to!r}: a whole number of tokens "
                         "per row, 2 to 16,777,216")
