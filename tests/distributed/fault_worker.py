"""Injected faults, real ones, grouped per launch (docs/reliability.md is built from what this records).

nonfinite: the last rank's loss at step 3 is NaN (its loss is multiplied by a NaN carried in the batch).
  skip: steps 4-5 must equal a run that never saw step 3 (parameters and optimizer untouched);
  raise: NonFiniteLossError on every rank before the update, naming step 3 and rank 1;
  raise_deferred (the default): NonFiniteLossError naming step 3 at a later step (the first whose
  start finds the device's record on the host), and a save right after step 3 is refused.
badbatch: at step 2 rank 1's batch lacks `labels`, is empty, or has float input_ids: BatchError on
  rank 1 before any collective. Rank 0 does not take that step (under a launcher the job would end);
  both then take a good step together, which only works if rank 1 issued no collective.
"""

import argparse
import json
import traceback
from pathlib import Path

import torch
from parity_worker import global_batches, optimizer_arg

from parallel import create_engine, load_spec
from parallel.toy import build_llama, llama_config

ROWS = 2


def loss_fn(model, batch):
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    return loss * batch["scale"][0] if "scale" in batch else loss


def engine_for(spec_dict):
    engine = create_engine(load_spec(spec_dict))
    torch.manual_seed(0)
    engine.prepare(build_llama(llama_config("tiny")), optimizer_arg("adamw"), loss_fn=loss_fn)
    return engine


def mine(engine, ids, poison=False):
    rows = engine.samples_per_step
    part = ids[engine.dp_rank * rows:(engine.dp_rank + 1) * rows]
    scale = torch.full((rows,), float("nan") if poison and engine.rank == engine.world_size - 1
                       else 1.0)
    return {"input_ids": part, "labels": part, "scale": scale}


def nonfinite(spec_dict, root: Path):
    batches = global_batches(5, 1, ROWS * 2)
    out = {}
    skip = engine_for({**spec_dict, "on_nonfinite": "skip"})
    results = [skip.train_step(mine(skip, ids, poison=i == 2)) for i, ids in enumerate(batches)]
    out["skip_losses"] = [r.loss for r in results]
    out["skip_stepped"] = [r.stepped for r in results]
    clean = engine_for(spec_dict)
    out["clean_losses"] = [clean.train_step(mine(clean, ids)).loss
                           for i, ids in enumerate(batches) if i != 2]
    out["raise"] = poisoned(engine_for({**spec_dict, "on_nonfinite": "raise"}), batches)
    out["deferred"] = poisoned(engine_for(spec_dict), batches)
    saving = engine_for(spec_dict)
    # the save is refused (the poisoned step): nothing may be written under the job's folder
    out["deferred_save"] = poisoned(saving, batches[:3], then=lambda: saving.save(root / "ckpt"))
    return out


def poisoned(engine, batches, then=None) -> str:
    """Train on `batches` (step 3 poisoned), then `then()`: the error raised, and at which step."""
    try:
        for i, ids in enumerate(batches):
            engine.train_step(mine(engine, ids, poison=i == 2))
        if then is not None:
            then()
        engine.check_finite(wait=True)
        return "no error"
    except Exception as err:  # noqa: BLE001 - the error itself is the result
        return f"{type(err).__name__} at step {engine.step + 1}: {err}"


def badbatch(spec_dict, root: Path):  # noqa: ARG001 - one signature
    out = {}
    batches = global_batches(3, 1, ROWS * 2)
    for fault in ("missing_labels", "empty", "float_ids"):
        engine = engine_for(spec_dict)
        engine.train_step(mine(engine, batches[0]))
        result = "no error"
        if engine.rank == engine.world_size - 1:  # the last rank (1, or 0 when alone)
            batch = mine(engine, batches[1])
            if fault == "missing_labels":
                batch.pop("labels")
            elif fault == "empty":
                batch = {k: v[:0] for k, v in batch.items()}
            else:
                batch["input_ids"] = batch["input_ids"].float()
            try:
                engine.train_step(batch)
            except Exception as err:  # noqa: BLE001
                result = f"{type(err).__name__}: {err}"
        # Every rank now takes a good step together: had the bad rank entered a collective, its
        # peers' next collectives would pair with it wrongly (an error or a hang, not this).
        after = engine.train_step(mine(engine, batches[2]))
        gathered = [None] * engine.world_size
        if torch.distributed.is_initialized():
            torch.distributed.all_gather_object(gathered, result)
        else:
            gathered = [result]
        out[fault] = {"errors": gathered, "next_step": after.step, "next_loss": after.loss}
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results = {}
    for name, spec_dict in json.load(open(args.cases)).items():
        for scenario in (nonfinite, badbatch):
            try:
                results[f"{name}/{scenario.__name__}"] = scenario(
                    spec_dict, Path(args.out).parent / f"{Path(args.out).stem}-{name}-save")
            except Exception:  # noqa: BLE001 - record and go on
                results[f"{name}/{scenario.__name__}"] = {"error": traceback.format_exc()}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        json.dump(results, open(args.out, "w"), indent=1)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
