"""LoRA (peft) with tensor parallelism: a PeftModel over the tiny Llama, LoRA on colwise (q, v, up)
and rowwise (o, down) projections, trained 3 steps on each case's backend at tp 2; rank 0 also trains
one process (the reference) and writes both. DeepSpeed AutoTP refuses LoRA naming why.

    lora_tp_worker.py --out OUT.json
"""

import argparse
from pathlib import Path
import json

import torch

from parallel import create_engine, load_spec
from parallel.spec.errors import SpecError
from parallel.toy import build_llama, llama_config

TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def lora_model():
    import peft

    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    return peft.get_peft_model(build_llama(llama_config("tiny")), cfg)


def batches():
    return torch.randint(0, 256, (3, 4, 16), generator=torch.Generator().manual_seed(1))


def reference() -> list[float]:
    model, ids, out = lora_model(), batches(), []
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for s in range(len(ids)):
        loss = model(input_ids=ids[s], labels=ids[s]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def run(spec: dict, save_to: Path | None = None) -> list[float] | str | dict:
    """The engine's losses (or the refusal); with `save_to`, also its eval loss on the first batch
    after training and engine.save_pretrained's adapter there (every rank writes its TP pieces)."""
    try:
        engine = create_engine(load_spec({**spec, "micro_batch_size": 4,
                                          "topology": {"procs_per_node": 2, "tp": 2}}))
    except SpecError as err:
        return str(err)
    try:
        engine.prepare(lora_model(), (torch.optim.AdamW, {"lr": 1e-2}))
    except SpecError as err:
        engine.close()
        return str(err)
    ids = batches()
    losses = [float(engine.train_step({"input_ids": ids[s], "labels": ids[s]}).loss)
              for s in range(len(ids))]
    if save_to is None:
        engine.close()
        return losses
    evaluated = engine.evaluate([{"input_ids": ids[0], "labels": ids[0]}])["loss"]
    engine.save_pretrained(save_to)
    seed = engine.spec.seed
    engine.close()
    return {"loss": losses, "eval": evaluated, "seed": seed}


def reloaded(save_to: Path, seed: int) -> float:
    """PeftModel.from_pretrained over the base as the run built it (the same seed, drawn first),
    evaluated on the first batch: the engine's own eval loss if the adapter is whole and named."""
    import peft

    torch.manual_seed(seed)
    model = peft.PeftModel.from_pretrained(build_llama(llama_config("tiny")), save_to)
    ids = batches()
    with torch.no_grad():
        return float(model(input_ids=ids[0], labels=ids[0]).loss)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch.distributed as dist

    saved = Path(args.out).with_name("lora-adapter")
    results = {"fsdp2": run({"backend": "fsdp"}, saved),
               "zero1": run({"backend": "deepspeed", "shard": "optimizer"})}
    if not dist.is_initialized() or dist.get_rank() == 0:
        results["reloaded"] = reloaded(saved, results["fsdp2"]["seed"])
        results["adapter_files"] = sorted(p.name for p in saved.iterdir())
        results["reference"] = reference()
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
