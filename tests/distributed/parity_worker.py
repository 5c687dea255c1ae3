"""Runs parity cases inside one launch (start-up costs ~5 s, so cases are grouped).

phase "train": for each case, a single-process reference (plain PyTorch, the whole global batch) and the
engine run (each rank its slice), 5 steps, saving after step `save_at`.
phase "resume": a fresh engine over a differently-initialised model trains one step, evaluates, then
loads that checkpoint and runs the remaining steps (under the case's "resume_spec" where it has one:
another layout or backend). Rank 0 writes every number to --out; the pytest side asserts.
"""

import argparse
import dataclasses
import hashlib
import json
import traceback
from pathlib import Path

import torch

from parallel import create_engine, load_spec
from parallel.checkpoint.state.portable import read_model
from parallel.engine.model.float8 import apply_float8
from parallel.engine.model.optim.recipes import hidden_matrices
from parallel.tools.parity.cell import one_process
from parallel.toy import OwnDecoder, build_llama, llama_config

SEQ, ROWS = 16, 2  # per rank and micro-batch: ROWS samples of SEQ tokens


SGD, ADAMW = {"lr": 0.5, "momentum": 0.9}, {"lr": 1e-2, "weight_decay": 0.1}
# several optimizers in one job: the hidden matrices' (recipes.hidden_matrices), AdamW the rest
SEVERAL = {"muon": (torch.optim.Muon, {"lr": 2e-2}), "two": (torch.optim.SGD, SGD)}


def optimizer_arg(name):
    if name in SEVERAL:
        hidden, kwargs = SEVERAL[name]
        return lambda groups: [hidden([g for g in groups if g["use_muon"]], **kwargs),
                               torch.optim.AdamW([g for g in groups if not g["use_muon"]],
                                                 **ADAMW)]
    if name == "sgd":
        return (torch.optim.SGD, SGD)
    return (torch.optim.AdamW, ADAMW)


def prepare_kwargs(name) -> dict:
    """What prepare takes beside the optimizer: the several optimizers' groups."""
    return {"param_groups": hidden_matrices()} if name in SEVERAL else {}


def plain_optimizer(name):
    """The reference's: plain torch optimizers over the model's own parameters, the same split."""
    if name not in SEVERAL:
        return optimizer_arg(name)

    def build(model):
        named = list(model.named_parameters())
        groups = hidden_matrices()(named)
        return optimizer_arg(name)([{**g, "params": [dict(named)[n] for n in g["params"]]}
                                    for g in groups])
    return build


def global_batches(steps, world, rows, seed=1234):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (world * rows, SEQ), generator=g) for _ in range(steps)]


def tiny(case):
    """The case's model: the tiny Llama (or {"toy": name}: another toy, e.g. mixtral), with the
    case's config overrides (e.g. tied embeddings), or with {"own": layers} a model of your own
    (toy.OwnDecoder); {"lora": r} wraps it in peft's LoRA of rank r (attention and down_proj)."""
    overrides = dict(case.get("model", {}))
    if "own" in overrides:
        return OwnDecoder(layers=overrides["own"])
    rank = overrides.pop("lora", None)
    model = build_llama(llama_config(overrides.pop("toy", "tiny"), **overrides))
    if rank is None:
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))


def reference(spec, case, batches, known: dict):
    """What one process computes on the global batch: the numbers every backend must reproduce.
    Computed once per job for each (seed, model, optimizer, clip, batches): the cases of a job that
    differ only in how the backend runs them share it (`known`; a quarter of FSDP's 33 cases' time)."""
    fp8 = spec.float8.model_dump(exclude={"all_gather", "base"}) if spec.precision == "fp8" else None
    key = json.dumps([spec.seed, case.get("model", {}), case["optimizer"], spec.grad_clip, fp8,
                      [digest(b) for b in batches]])
    if key not in known:
        torch.manual_seed(spec.seed)
        model = tiny(case)
        if fp8 is not None:  # the same torchao conversion, in fp32 (float8.base: bf16 cases
            # state their tolerance against it, as precision: bf16's do against fp32)
            apply_float8(model, spec.float8.model_copy(update={"all_gather": False}),
                         torch.device("cpu"), lambda _: None)
        record = one_process(model, plain_optimizer(case["optimizer"]), batches, spec.grad_clip)
        known[key] = [r["loss"] for r in record], [r["grad_norm"] for r in record]
    return known[key]


def shard_scales(parts):
    """float8.all_gather's scales from each rank's shard of a weight alone, where torchao computes
    them over the whole weight (a deliberately wrong engine, for the test that must tell)."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import tensor_to_scale

    for part in parts:
        for m in part.modules():
            if isinstance(m, Float8Linear):
                local = m.weight._local_tensor
                local._precomputed_scale = tensor_to_scale(local._tensor, torch.float8_e4m3fn)


def digest(batch) -> str:
    items = sorted(batch.items()) if isinstance(batch, dict) else [("input_ids", batch)]
    return hashlib.sha256(b"".join(k.encode() + v.numpy().tobytes() for k, v in items)).hexdigest()


def padded(ids, seed):
    """Right-padded SFT rows of different lengths (4..SEQ real tokens): attention mask 0 and label
    -100 on the padding, so ranks and micro-batches hold different numbers of targets."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, SEQ + 1, (ids.shape[0], 1), generator=g)
    real = torch.arange(SEQ).expand_as(ids) < lengths
    return {"input_ids": torch.where(real, ids, 0), "attention_mask": real.long(),
            "labels": torch.where(real, ids, -100)}


def rank_slice(batch, rank, rows):
    if isinstance(batch, dict):
        return {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}
    mine = batch[rank * rows:(rank + 1) * rows]
    return {"input_ids": mine, "labels": mine}


def fed(engine, batches):
    """The step batches as users feed them: every global batch's rows in one dataset, through
    engine.dataloader (each rank's rows, placed on the device as the backend places a loader's:
    XLA's MpDeviceLoader with its input sharding). Its sampler deals each step's rows out over
    the data-parallel ranks (rank r: rows r, r + W, ...), so a step holds the global batch's rows,
    as one process does."""
    rows = [{k: v[i] for k, v in (b if isinstance(b, dict) else {"input_ids": b, "labels": b}
                                  ).items()} for b in batches for i in range(len(next(iter(
                                      b.values())) if isinstance(b, dict) else b))]
    return engine.dataloader(rows, shuffle=False, name=f"parity-{engine.step}")


def run_case(case, phase, ckpt_root, known: dict):
    # "resume_spec": the checkpoint loads into another layout or backend (the transfer cases)
    data = case["resume_spec"] if phase == "resume" and "resume_spec" in case else case["spec"]
    runs = Path(ckpt_root) / f"{case['name']}-{phase}-runs"
    if case.get("tracked"):  # every `tracked` steps to metrics.jsonl (the trackers' own view)
        data = {**data, "tracking": {"to": ["jsonl"], "every": case["tracked"], "dir": str(runs),
                                     "run_name": "run"}}
    spec = load_spec(data)
    engine = create_engine(spec)
    rows = engine.samples_per_step  # per process: all its devices' samples under SPMD
    batches = global_batches(case["steps"], engine.dp_size, rows)
    if case.get("padded"):
        batches = [padded(ids, i) for i, ids in enumerate(batches)]
    out = {}
    if phase == "train":
        out["ref_loss"], out["ref_norm"] = reference(spec, case, batches, known)
        torch.manual_seed(spec.seed)
        factory = lambda: tiny(case)  # noqa: E731
    else:
        def factory():  # different weights: only a working load() can reproduce the losses
            torch.manual_seed(spec.seed + 99)
            return tiny(case)
    engine.prepare(factory if case.get("factory") else factory(), optimizer_arg(case["optimizer"]),
                   **prepare_kwargs(case["optimizer"]))
    if case.get("shard_amax"):  # the bug test_float8 must catch: each shard's own weight scale
        engine.float8.refresh = lambda parts: shard_scales(parts)
        shard_scales(engine.model_parts)
    if case.get("default_scaling"):  # topology.pp: the schedule's default (each micro-batch's mean)
        engine.pipeline.scale_grads = True
    ckpt = f"{ckpt_root}/{case['name']}"
    start = 0
    if phase == "resume":
        # The load lands on an engine that has trained and evaluated, not a fresh one: it must
        # replace all of that (optimizer state and step counts, and FSDP1's root unit, which an
        # evaluation leaves gathered: the next forward ran on the old weights, 1.2e-2 off).
        mine = rank_slice(batches[0], engine.dp_rank, rows)
        engine.train_step(mine)
        engine.evaluate([mine])
        # the weights alone first: the step and optimizer stay this engine's, and an evaluation
        # on the next batch sees the loss the uninterrupted run saw there
        engine.load(ckpt, weights_only=True)
        after = rank_slice(batches[case["save_at"]], engine.dp_rank, rows)
        out["weights_only"] = {"step": engine.step,
                               "loss": engine.evaluate([after])["loss"]}
        engine.load(ckpt)
        start = engine.step
    losses, norms = [], []
    for step, batch in zip(range(start, case["steps"]), fed(engine, batches[start:])):
        result = engine.train_step(batch)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        if phase == "train" and engine.step == case["save_at"]:
            engine.save(ckpt)
            if case.get("pretrained"):  # the Hugging Face export of the same weights
                engine.save_pretrained(f"{ckpt}-hf")
            if case.get("eval_at_save"):  # where the step's loss is not evaluate's (a MoE
                # model's balancing loss): what the weights-only load must evaluate to
                after = rank_slice(batches[case["save_at"]], engine.dp_rank, rows)
                out["eval_at_save"] = engine.evaluate([after])["loss"]
    out.update(loss=losses, norm=norms, start=start, notices=engine.notices)
    if case.get("generate_refused"):  # topology.pp: refused naming the fix, on every rank alike
        try:
            engine.generate(torch.zeros(1, 4, dtype=torch.long), max_new_tokens=2)
        except ValueError as err:
            out["generate_refused"] = str(err)
    if case.get("generate"):  # greedy tokens from the trained model, every rank the same prompt
        prompt = torch.arange(1, 6).unsqueeze(0)
        out["generated"] = engine.generate(prompt, max_new_tokens=4, do_sample=False).tolist()
        whole = engine.gather_model()  # every rank: a collective
        if engine.is_main:  # the same from a plain model with the gathered weights
            plain = tiny(case)
            plain.load_state_dict(whole)
            out["plain_generated"] = plain.generate(prompt, max_new_tokens=4, do_sample=False,
                                                    output_router_logits=False).tolist()
    if phase == "train" and engine.is_main:
        # A plain PyTorch model with the checkpoint's weights of step save_at (read whole, in one
        # process) must see the loss the engine saw at the next step.
        plain = tiny(case)
        plain.load_state_dict(read_model(Path(ckpt)))
        whole = batches[case["save_at"]]
        kwargs = whole if isinstance(whole, dict) else {"input_ids": whole, "labels": whole}
        out["consolidated_loss"] = plain(**kwargs).loss.item()
        if case.get("pretrained"):
            from transformers import AutoModelForCausalLM

            exported = AutoModelForCausalLM.from_pretrained(f"{ckpt}-hf")
            out["pretrained_loss"] = exported(**kwargs).loss.item()
    if case.get("tracked") and engine.is_main:  # the sink flushes every line
        lines = (runs / "run" / "metrics.jsonl").read_text().splitlines()
        out["tracked"] = [json.loads(line) for line in lines if '"train/loss"' in line]
    out.update(getattr(engine, "parity_facts", lambda: {})())
    stats = engine.compile_stats()
    if stats is not None:
        out["compile"] = dataclasses.asdict(stats)
    if phase == "train":  # how many chunks hold each stored matrix (sharded writes one per shard)
        from parallel.checkpoint.state.portable import metadata

        md = metadata(Path(ckpt)).state_dict_metadata
        out["chunks"] = max(len(md[k].chunks) for k in md if k.startswith("model.") and
                            len(md[k].size) == 2)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True)
    p.add_argument("--phase", choices=["train", "resume"], required=True)
    p.add_argument("--ckpt-root", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results, known = {}, {}
    engine_rank = 0
    for case in json.load(open(args.cases)):
        try:
            results[case["name"]] = run_case(case, args.phase, args.ckpt_root, known)
        except Exception:  # record it and go on: one broken case must not hide the others
            results[case["name"]] = {"error": traceback.format_exc()}
    if torch.distributed.is_initialized():
        engine_rank = torch.distributed.get_rank()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if engine_rank == 0:
        json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
