"""`engine.evaluate(loader)`: no-grad forward over an evaluation loader on the sharded model, and the
loss one process would report on the same samples: token-weighted (the sum of every target token's
loss over the number of target tokens, not a mean of batch means), with its perplexity, and user
metrics as (numerator, denominator) sums. Every sum is accumulated on the device and reduced over
ranks in one collective at the end: no host read per batch.

A metric is a callable `(outputs, batch) -> {name: (numerator, denominator)}` on this rank's batch
(outputs: the model's output, e.g. a transformers ModelOutput with `.logits`); the result is
sum(numerator) / sum(denominator) over every batch of every rank. `token_accuracy` is one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from parallel.engine import dist as pdist

IGNORE = -100  # transformers' label for "no target here" (padding, prompt tokens)
Metric = Callable[[object, dict], dict]


def token_accuracy(outputs, batch) -> dict:
    """Next-token accuracy of a causal LM over target tokens (labels != -100)."""
    predicted = outputs.logits[:, :-1].argmax(-1)
    labels = batch["labels"][:, 1:]
    mask = labels != IGNORE
    # a name ending in "/" is the denominator of the name before it
    return {"token_accuracy": ((predicted == labels) & mask).sum(), "token_accuracy/": mask.sum()}


def run(engine, loader, metrics: list[Metric], max_batches: int | None) -> dict:
    from parallel.engine.loaders import plain_batch

    model = engine.model
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    # float64 sums where the device has them (TPUs compute float64 slowly, if at all)
    dtype = torch.float32 if engine.device.type == "xla" else torch.float64

    def add(name: str, value) -> None:
        value = torch.as_tensor(value, device=engine.device).to(dtype)
        sums[name] = sums[name] + value if name in sums else value

    batches = 0
    with torch.no_grad():
        for batch in loader:
            if max_batches is not None and batches >= max_batches:
                break
            batch = engine._to_device(plain_batch(batch))
            with engine._autocast():
                if engine.loss_fn is not None:
                    outputs, loss = None, engine.loss_fn(model, batch)
                else:
                    outputs = model(**batch)
                    loss = outputs.loss
            # the items this loss averages over (target tokens for a causal LM; the objective
            # knows the model's rule, objective.py): a batch without targets adds nothing
            counts = engine.objective.counts([batch])
            weight = counts[0] if counts is not None else 1
            kept = loss.detach().float() if counts is None else torch.where(
                weight > 0, loss.detach().float(), torch.zeros_like(loss.detach().float()))
            add("loss", kept * weight)
            add("loss/", weight)
            for metric in metrics:
                for name, value in metric(outputs, batch).items():
                    add(name, value)
            batches += 1
    return _reduce(sums, batches)


def _reduce(sums: dict, batches: int) -> dict:
    names = sorted(sums)
    packed = torch.stack([sums[n] for n in names]) if names else torch.zeros(0)
    if packed.numel():
        packed = pdist.PendingSum(packed)()  # one collective for every sum
    total = dict(zip(names, packed.tolist()))
    out = {"batches": batches}
    for name in names:
        if name.endswith("/"):
            continue
        denominator = total.get(name + "/", 0.0) or float("nan")
        out[name] = total[name] / denominator
    if "loss" in out:
        out["perplexity"] = math.exp(out["loss"]) if out["loss"] < 700 else float("inf")
    return out
