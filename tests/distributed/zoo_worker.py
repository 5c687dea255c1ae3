"""The model zoo (zoo.py) on real backends, grouped per launch.

phase "save": for each backend of this launch and each model, train 3 steps from the reference's
initial weights on the shared global batches and save to <root>/<backend>-<model>.
phase "load": for each backend of this launch and each model, a fresh engine over other initial weights
loads the checkpoint that `--source-of` names for it (another backend's), and trains steps 4 and 5.
Rank 0 writes the losses, and each model's single-process reference, to --out; pytest asserts.
"""

import argparse
import json
import traceback
from pathlib import Path

import torch
import zoo

from parallel import create_engine, load_spec

GLOBAL_ROWS, STEPS, SAVE_AT, SEED = 4, 5, 3, 0


def engine_for(backends: dict, backend: str, model_name: str, seed: int):
    spec = load_spec({**zoo.spec_for(model_name, backend, backends[backend]), "seed": SEED})
    engine = create_engine(spec)
    rows = engine.samples_per_step
    if rows * engine.world_size != GLOBAL_ROWS:
        raise ValueError(f"{backend}: {rows} rows x {engine.world_size} ranks != {GLOBAL_ROWS}")
    torch.manual_seed(seed)
    model = zoo.ZOO[model_name]["build"]()
    engine.prepare(model, zoo.optimizer_for(model_name, model),
                   loss_fn=zoo.ZOO[model_name].get("loss_fn"))
    return engine, rows


def train(engine, rows, batches, steps):
    return [engine.train_step(zoo.slice_rows(batches[s], engine.rank * rows,
                                             (engine.rank + 1) * rows)).loss for s in steps]


def batches_of(model_name):
    return zoo.ZOO[model_name]["batches"](STEPS, GLOBAL_ROWS, SEED + 1)


def run(phase, backends, names, root, source_of, models):
    out = {}
    for backend in names:
        for model_name in models:
            key = f"{backend}-{model_name}"
            try:
                if phase == "save":
                    engine, rows = engine_for(backends, backend, model_name, SEED)
                    out[key] = {"loss": train(engine, rows, batches_of(model_name), range(SAVE_AT)),
                                "notices": engine.notices}
                    engine.save(root / key)
                else:
                    source = source_of[key]
                    engine, rows = engine_for(backends, backend, model_name, SEED + 99)
                    engine.load(root / source)
                    out[key] = {"source": source, "start": engine.step, "loss": train(
                        engine, rows, batches_of(model_name), range(engine.step, STEPS)),
                        "notices": engine.notices}
            except Exception:  # record it and go on: one broken case must not hide the others
                out[key] = {"error": traceback.format_exc()}
    return out


def refusals(phase, backends, names, root, source_of):
    """What cannot work must fail at prepare / load, naming the cause."""
    out = {}
    if phase == "save" and "xla1" in names:  # default flatten_parameters: a unit is one tensor
        spec = {**backends["xla1"], "wrap": zoo.ZOO["groups"]["wrap"], "seed": SEED}
        out["refusal-xla1-split-groups"] = _error_of(lambda: _prepare_groups(spec))
    zero = [n for n in names if backends[n]["backend"] == "deepspeed"]
    if phase == "load" and zero:  # two groups saved, two other groups here
        def load_into_other_groups():
            spec = {**backends[zero[0]], "wrap": zoo.ZOO["groups"]["wrap"], "seed": SEED}
            engine = create_engine(load_spec(spec))
            swapped = lambda named: [  # noqa: E731 - the checkpoint's groups, the other way round
                {"params": [n for n, p in named if zoo.no_decay(n, p)]},
                {"params": [n for n, p in named if not zoo.no_decay(n, p)], "weight_decay": 0.0}]
            engine.prepare(zoo.ZOO["groups"]["build"](), (torch.optim.AdamW, {"lr": zoo.LR}),
                           param_groups=swapped)
            engine.load(root / source_of[f"{zero[0]}-groups"])  # another backend's
        out["refusal-zero-other-groups"] = _error_of(load_into_other_groups)
    return out


def _prepare_groups(spec):
    engine = create_engine(load_spec(spec))
    model = zoo.ZOO["groups"]["build"]()
    engine.prepare(model, zoo.optimizer_for("groups", model))


def _error_of(fn) -> dict:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the error is the result
        return {"error_type": type(err).__name__, "message": str(err)}
    return {"error_type": None, "message": "no error"}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["save", "load"], required=True)
    p.add_argument("--backends", required=True, help="JSON file: {name: spec}")
    p.add_argument("--names", required=True, help="comma-separated backends of this launch")
    p.add_argument("--source-of", required=True, help="JSON file: {backend-model: the checkpoint "
                   "it loads}")
    p.add_argument("--models", required=True, help="comma-separated zoo models of this launch")
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    backends = json.loads(Path(args.backends).read_text())
    names = args.names.split(",")
    results = run(args.phase, backends, names, Path(args.root),
                  json.loads(Path(args.source_of).read_text()), args.models.split(","))
    results.update(refusals(args.phase, backends, names, Path(args.root),
                            json.loads(Path(args.source_of).read_text())))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        for model_name in args.models.split(","):
            results[f"reference-{model_name}"] = zoo.reference(model_name, SEED,
                                                               batches_of(model_name))
        Path(args.out).write_text(json.dumps(results, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
