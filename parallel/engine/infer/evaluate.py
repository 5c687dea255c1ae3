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
from typing import Protocol

import torch

from parallel import dist as pdist

IGNORE = -100  # transformers' label for "no target here" (padding, prompt tokens)
Metric = Callable[[object, dict], dict]


def token_accuracy(outputs, batch) -> dict:
    """Next-token accuracy of a causal LM over target tokens (labels != -100). With topology.cp a
    rank holds its slice of each row and `shift_labels`, the targets shifted before the split."""
    if "shift_labels" in batch:
        predicted, labels = outputs.logits.argmax(-1), batch["shift_labels"]
    else:
        predicted, labels = outputs.logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
    mask = labels != IGNORE
    # a name ending in "/" is the denominator of the name before it
    return {"token_accuracy": ((predicted == labels) & mask).sum(), "token_accuracy/": mask.sum()}


class Evaluated(Protocol):
    """What evaluation needs of the engine: its public port, nothing private."""

    model: torch.nn.Module
    device: torch.device
    world_size: int
    forward_gathers: bool  # every rank must run as many forwards as the busiest one
    groups: object  # parallel.dist.Groups: whose sums the result is
    objective: object  # what each batch's loss averages over (parallel/kits/objective.py)

    def device_batch(self, batch): ...

    def forward(self, batch, logits: bool = False) -> tuple[object, torch.Tensor]: ...


def run(engine: Evaluated, loader, metrics: list[Metric], max_batches: int | None) -> dict:
    pipeline = getattr(engine, "pipeline", None)
    if pipeline is not None and metrics:
        raise ValueError("engine.evaluate(metrics=...) with topology.pp: the last stage alone holds "
                         "the logits a metric reads; evaluate the loss alone under pp, or compute "
                         "metrics at topology.pp: 1 (engine.save_pretrained, then a pp 1 job)")
    for part in getattr(engine, "model_parts", [engine.model]):
        part.eval()
    sums: dict[str, torch.Tensor] = {}
    # float64 sums where the device has them (TPUs compute float64 slowly, if at all)
    dtype = torch.float32 if engine.device.type == "xla" else torch.float64

    def add(name: str, value) -> None:
        value = torch.as_tensor(value, device=engine.device).to(dtype)
        sums[name] = sums[name] + value if name in sums else value

    batches = 0
    with torch.no_grad():
        for batch, real in lockstep(engine, loader, max_batches):
            batch = engine.device_batch(batch)
            # the items this loss averages over (target tokens for a causal LM; the objective
            # knows the model's rule, objective.py): a batch without targets adds nothing
            counts = engine.objective.counts([batch])
            if pipeline is None:
                outputs, loss = engine.forward(batch, logits=bool(metrics))  # metrics read them
            else:  # the stages' forwards: the last stage's mean, weighed there alone
                outputs, loss = None, pipeline.mean_loss(batch, counts[0])
            if not real:  # a forward to keep ranks in step: it adds nothing
                continue
            loss = loss.detach().float()
            weight = counts[0] if counts is not None else 1
            weight = weight if pipeline is None or pipeline.last else torch.zeros_like(weight)
            if counts is not None:  # no targets: the model's loss is NaN (0 / 0), weighed by 0
                loss = torch.where(weight > 0, loss, torch.zeros_like(loss))
            add("loss", loss * weight)
            add("loss/", weight)
            for metric in metrics:
                for name, value in metric(outputs, batch).items():
                    add(name, value)
            batches += 1
    # under pp the last stage's ranks hold the sums: over the world (a tp group's copies scale a
    # numerator and its denominator alike)
    return _reduce(sums, batches, engine.groups.dp if pipeline is None else pdist.WORLD)


def lockstep(engine, loader, max_batches: int | None):
    """(batch, real) until every rank's share is done. Where forwards gather parameters (FSDP,
    ZeRO-3) every rank must run as many forwards as the rank with the most batches: a rank whose
    share ran out repeats its first batch (real=False, weight 0). A map-style eval loader knows
    that count on every rank (no collective); a stream's ranks agree once per batch (one
    two-element all-reduce and its host read: evaluation only, never in the training step)."""
    if engine.world_size == 1 or not engine.forward_gathers:
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                return
            yield batch, True
        return
    known = getattr(loader, "lockstep", None)
    stream, first, done = iter(loader), None, 0
    while max_batches is None or done < max_batches:
        if known is not None and done >= known:
            return
        batch = next(stream, None)
        if known is None:  # [some rank has a batch, some rank has none and never had one]
            flags = torch.tensor([batch is not None, batch is None and first is None],
                                 dtype=torch.float32, device=engine.device)
            # every rank whose forwards gather takes part: the world
            flags = pdist.all_max(flags, pdist.WORLD).tolist()
            if not flags[0]:
                return
            if flags[1]:
                raise RuntimeError(
                    "engine.evaluate: a rank's share of the evaluation stream is empty while "
                    "others still evaluate, and a forward gathers parameters from every rank; give "
                    "the stream at least one batch per data-parallel rank")
        first = batch if first is None else first
        if batch is None and first is None:
            raise RuntimeError("engine.evaluate: this rank's share of the evaluation data is "
                               "empty; give it at least one sample per data-parallel rank")
        yield (batch, True) if batch is not None else (first, False)
        done += 1


def _reduce(sums: dict, batches: int, group) -> dict:
    """Every sum over `group`, the data-parallel ranks (they hold distinct samples; a TP group's
    ranks hold the same ones), in one collective."""
    names = sorted(sums)
    packed = torch.stack([sums[n] for n in names]) if names else torch.zeros(0)
    if packed.numel():
        packed = pdist.PendingSum(packed, group)()
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
