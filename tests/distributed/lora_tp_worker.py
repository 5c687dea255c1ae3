"""LoRA (peft) with tensor parallelism: a PeftModel over the tiny Llama, LoRA on colwise (q, v, up)
and rowwise (o, down) projections, trained 3 steps on each case's backend at tp 2; rank 0 also trains
one process (the reference) and writes both. DeepSpeed AutoTP refuses LoRA naming why.

    lora_tp_worker.py --out OUT.json
"""

import argparse
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


def run(spec: dict) -> list[float] | str:
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
    engine.close()
    return losses


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch.distributed as dist

    results = {"fsdp2": run({"backend": "fsdp"}),
               "zero1": run({"backend": "deepspeed", "shard": "optimizer"})}
    if not dist.is_initialized() or dist.get_rank() == 0:
        results["reference"] = reference()
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
