"""One backend's side of `polyshard parity`, started on every rank by `polyshard parity` (torchrun).

Builds the model from the shared seed, trains `--steps` steps on the shared global batches (each rank
its slice) and records, per step, the global loss, the gradient norm and a checksum of the whole
weights. Rank 0 writes them to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from parallel.launch.torchrun import current_spec
from parallel.registry import create_engine
from parallel.kits.measurable import measurable
from parallel.engine.model.optim.recipes import hidden_matrices, muon_with_adamw
from parallel.toy import build_model


def global_batches(steps: int, rows: int, seq: int, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, vocab, (rows, seq), generator=g) for _ in range(steps)]


def optimizer_arg(name: str, lr: float):
    """What `prepare` takes: adamw, sgd, or muon (Muon on the hidden matrices and AdamW on the
    rest, both at `lr`: recipes.muon_with_adamw, with prepare_kwargs' groups)."""
    if name == "muon":
        return muon_with_adamw({"lr": lr}, {"lr": lr, "weight_decay": 0.1})
    if name == "sgd":
        return torch.optim.SGD, {"lr": lr, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": lr, "weight_decay": 0.1}


def prepare_kwargs(name: str) -> dict:
    """What `prepare` takes beside the optimizer: muon's groups (recipes.hidden_matrices)."""
    return {"param_groups": hidden_matrices()} if name == "muon" else {}


def plain_optimizer(name: str, lr: float):
    """one_process' optimizer: optimizer_arg's, built over the model's own parameters (muon:
    plain torch.optim.Muon and AdamW over the same groups)."""
    if name != "muon":
        return optimizer_arg(name, lr)

    def build(model):
        named = dict(model.named_parameters())
        return optimizer_arg(name, lr)([{**g, "params": [named[n] for n in g["params"]]}
                                        for g in hidden_matrices()(list(named.items()))])
    return build


def one_process(model, optimizer, batches, grad_clip: float | None,
                checksums: bool = False) -> list[dict]:
    """The reference every backend must reproduce: one process, plain PyTorch, the whole global
    batch; per step the loss, the gradient norm and (checksums) the weights' checksum.
    `optimizer`: (class, kwargs) over every parameter, or a callable giving the model's optimizers
    (several in one job), stepped in order."""
    if callable(optimizer):
        opts = optimizer(model)
    else:
        cls, kwargs = optimizer
        opts = [cls(model.parameters(), **kwargs)]
    record = []
    for batch in batches:  # token ids (their own labels) or the model's keyword arguments
        loss = model(**(batch if isinstance(batch, dict) else {"input_ids": batch,
                                                               "labels": batch})).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        record.append({"loss": loss.item(), "grad_norm": norm.item(),
                       **({"checksum": checksum(dict(model.state_dict()))} if checksums else {})})
    return record


def checksum(weights: dict[str, torch.Tensor]) -> float:
    """Sum of every weight in float64, in name order: equal across backends only if the weights are."""
    return float(sum(weights[k].double().sum() for k in sorted(weights)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="toy:tiny")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--optimizer", choices=["adamw", "sgd", "muon"], default="adamw")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--global-rows", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    spec = current_spec()
    engine = create_engine(spec)
    torch.manual_seed(spec.seed)  # the same initial weights as the reference, on every backend
    model = build_model(args.model)
    engine.prepare(model, optimizer_arg(args.optimizer, args.lr), **prepare_kwargs(args.optimizer))
    rows = engine.samples_per_step
    if rows * engine.dp_size != args.global_rows:  # tensor-parallel ranks share their slice
        raise SystemExit(f"{spec.backend}: {rows} rows x {engine.dp_size} data-parallel ranks per "
                         f"step, not the "
                         f"global batch of {args.global_rows}")
    batches = global_batches(args.steps, args.global_rows, args.seq, model.config.vocab_size,
                             spec.seed)
    record = []
    for ids in batches:
        mine = ids[engine.dp_rank * rows:(engine.dp_rank + 1) * rows]
        result = engine.train_step({"input_ids": mine, "labels": mine})
        record.append({"loss": result.loss, "grad_norm": result.grad_norm,
                       "checksum": checksum(measurable(engine, "polyshard parity").gather_model())})
    if engine.is_main:
        Path(args.out).write_text(json.dumps({"steps": record, "world_size": engine.world_size}))
    engine.close()


if __name__ == "__main__":
    main()
