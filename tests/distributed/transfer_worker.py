"""Checkpoint transfer between backends, grouped into few launches (each costs 10-25 s).

phase "save": for each source backend in this launch and each optimizer, train 3 steps from the
reference initial weights on the shared global batches, save to <root>/<source>-<optimizer>.
phase "load": for each target backend in this launch and each checkpoint --plan lists for it (every
saved one without --plan), a fresh engine over differently-initialised weights loads it and trains
steps 4 and 5. A checkpoint whose name starts with "weights_" is loaded with weights_only=True: the
engine keeps its fresh optimizer and step 0, trains on steps 4 and 5's batches, and must give one
process's losses over the saved weights with a fresh optimizer ("reference-weights-<optimizer>"); a
plain load of it must be refused, naming weights_only. Rank 0 writes every number, and the
single-process reference losses, to --out; the pytest side asserts.
"""

import argparse
import json
import traceback
from pathlib import Path

import torch
from parity_worker import global_batches, optimizer_arg, rank_slice, reference, tiny

from parallel import create_engine, load_spec
from parallel.tools.parity.cell import one_process
from parallel.toy import build_llama, llama_config

GLOBAL_ROWS, STEPS, SAVE_AT = 4, 5, 3
OPTIMIZERS = ("sgd", "adamw")


def engine_for(spec_dict, seed_offset):
    spec = load_spec(spec_dict)
    engine = create_engine(spec)
    rows = engine.samples_per_step
    if rows * engine.dp_size != GLOBAL_ROWS:
        raise ValueError(f"{spec_dict}: {rows} rows x {engine.dp_size} dp ranks != {GLOBAL_ROWS}")
    torch.manual_seed(spec.seed + seed_offset)
    return engine, rows


def train(engine, rows, batches, steps):
    return [engine.train_step(rank_slice(batches[s], engine.dp_rank, rows)).loss for s in steps]


def save_phase(backends, names, root, optimizers=OPTIMIZERS):
    out = {}
    for name in names:
        for opt in optimizers:
            try:
                engine, rows = engine_for(backends[name], 0)
                engine.prepare(build_llama(llama_config("tiny")), optimizer_arg(opt))
                batches = global_batches(STEPS, 1, GLOBAL_ROWS)
                out[f"{name}-{opt}"] = {"loss": train(engine, rows, batches, range(SAVE_AT))}
                engine.save(root / f"{name}-{opt}")
                if backends[name].get("topology", {}).get("tp", 1) > 1:
                    out[f"{name}-{opt}"]["hf"] = hf_as_saved(engine, root / f"{name}-{opt}")
            except Exception:  # record it and go on: one broken case must not hide the others
                out[f"{name}-{opt}"] = {"error": traceback.format_exc()}
    return out


def hf_as_saved(engine, saved: Path) -> dict | None:
    """save_pretrained of a tensor-parallel layout (column blocks: a run per row written in place,
    hf_gather.runs), in files of 40 KB: on rank 0, which tensors differ from the checkpoint's own
    weights read whole (None on the other ranks)."""
    from safetensors.torch import load_file

    from parallel.checkpoint.hf.hf_files import plain_weights

    out = engine.save_pretrained(saved.with_name(saved.name + "-hf"), max_shard_bytes=40_000)
    if engine.rank != 0:
        return None
    cfg = json.loads((out / "config.json").read_text())
    files = sorted(out.glob("*.safetensors"))
    got = {k: v for f in files for k, v in load_file(f).items()}
    want = {name: read() for name, _, read in plain_weights(saved, cfg)}
    return {"files": len(files), "names": sorted(set(got) ^ set(want)),
            "differ": sorted(k for k in set(got) & set(want)
                             if not torch.equal(got[k], want[k].to(got[k].dtype)))}


def load_phase(backends, names, root, plan=None):
    out = {}
    saved = sorted(p.name for p in root.iterdir() if (p / "manifest.json").is_file())
    for name in names:
        for source in plan[name] if plan else saved:
            opt = source.rsplit("-", 1)[1]
            key = f"{source.rsplit('-', 1)[0]}->{name}-{opt}"
            try:
                engine, rows = engine_for(backends[name], 99)  # other weights: only load() helps
                engine.prepare(build_llama(llama_config("tiny")), optimizer_arg(opt))
                batches = global_batches(STEPS, 1, GLOBAL_ROWS)
                if source.startswith("weights_"):
                    out[key] = weights_only(engine, rows, root / source, batches)
                    continue
                engine.load(root / source)
                out[key] = {"start": engine.step,
                            "loss": train(engine, rows, batches, range(engine.step, STEPS))}
            except Exception:
                out[key] = {"error": traceback.format_exc()}
    return out


def weights_only(engine, rows, path: Path, batches) -> dict:
    """A checkpoint without optimizer state: a plain load refused first (refused before anything
    is read, so the engine is untouched). Then the weights alone: the engine's step stays 0, its
    optimizer fresh; it trains on the batches after SAVE_AT."""
    from parallel.checkpoint.state.portable import stored_keys

    refused = None
    if "optim.param_groups" not in stored_keys(path):
        try:
            engine.load(path)
            refused = "loaded"
        except Exception as err:  # noqa: BLE001 - what the refusal says is the result
            refused = str(err)
    engine.load(path, weights_only=True)
    start = engine.step
    return {"start": start, "refused": refused, "loss": [
        engine.train_step(rank_slice(batches[s], engine.dp_rank, rows)).loss
        for s in range(SAVE_AT, STEPS)]}


def weights_reference(spec, opt: str, batches) -> list[float]:
    """One process: SAVE_AT steps, then a fresh optimizer over those weights for the rest (what a
    weights-only load of the step-SAVE_AT checkpoint continues)."""
    torch.manual_seed(spec.seed)
    model = tiny({})
    one_process(model, optimizer_arg(opt), batches[:SAVE_AT], spec.grad_clip)
    return [r["loss"] for r in one_process(model, optimizer_arg(opt), batches[SAVE_AT:],
                                           spec.grad_clip)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["save", "load"], required=True)
    p.add_argument("--backends", required=True, help="JSON file: {name: spec}")
    p.add_argument("--names", required=True, help="comma-separated backends run in this launch")
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="save: which to train with")
    p.add_argument("--plan", help="load: JSON file {target: [checkpoint names to load]} "
                   "(default: every checkpoint under --root)")
    args = p.parse_args()
    backends, root = json.loads(Path(args.backends).read_text()), Path(args.root)
    names = args.names.split(",")
    if args.phase == "save":
        results = save_phase(backends, names, root, args.optimizers.split(","))
    else:
        plan = json.loads(Path(args.plan).read_text()) if args.plan else None
        results = load_phase(backends, names, root, plan)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        spec = load_spec(backends[names[0]])
        batches = global_batches(STEPS, 1, GLOBAL_ROWS)
        for opt in args.optimizers.split(","):
            results[f"reference-{opt}"] = {"loss": reference(spec, {"optimizer": opt}, batches, {})[0]}
            if any(p.name.startswith("weights_") for p in root.iterdir()):
                results[f"reference-weights-{opt}"] = {"loss": weights_reference(spec, opt, batches)}
        Path(args.out).write_text(json.dumps(results, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
