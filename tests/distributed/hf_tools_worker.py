"""Hugging Face tools inside a polyshard ZeRO-3 job (2 gloo ranks): transformers sees ZeRO-3 inside
engine.unwrap() (so `generate` keeps ranks in step) and not outside it, a from_pretrained factory
under deepspeed.zero_init loads the weights
into the partitions, and sampling with early EOS on ranks that stop at different steps finishes."""

import json
import sys

import torch
from transformers import LlamaForCausalLM
from transformers.integrations import is_deepspeed_zero3_enabled

from parallel import create_engine, load_spec

pretrained, out, zero_init = sys.argv[1], sys.argv[2], sys.argv[3] == "zero_init"
if True:  # one engine per process: DeepSpeed keeps its process groups for the process's life
    spec = load_spec({"backend": "deepspeed", "shard": "full", "topology": {"procs_per_node": 2},
                      "micro_batch_size": 2, "deepspeed": {"zero_init": zero_init,
                                                           "param_persistence_threshold": 0}})
    engine = create_engine(spec)
    engine.prepare(lambda: LlamaForCausalLM.from_pretrained(pretrained, dtype=torch.float32),
                   (torch.optim.AdamW, {"lr": 1e-3}))
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    mine = ids[engine.dp_rank * 2:(engine.dp_rank + 1) * 2]
    loss = engine.eval_step({"input_ids": mine, "labels": mine})
    # rank 1 stops after its first token (every token is its EOS), rank 0 samples on: without
    # synced_gpus rank 1 would leave generate while rank 0 still gathers parameters (a hang)
    # the model called directly, as the docs say: inside engine.unwrap(), where transformers sees
    # ZeRO-3 (#64: outside it, and after the job, a plain from_pretrained stays plain)
    outside = is_deepspeed_zero3_enabled()
    torch.manual_seed(engine.rank)
    with engine.unwrap() as module:
        inside = is_deepspeed_zero3_enabled()
        generated = module.generate(mine[:1, :4], max_new_tokens=6, do_sample=True,
                                    pad_token_id=0,
                                    eos_token_id=list(range(256)) if engine.rank == 1 else 10_000)
    counts = [None, None]
    torch.distributed.all_gather_object(counts, generated.shape[1] - 4)
    result = {"zero3_seen": inside, "outside_unwrap": outside, "loss": loss, "new_tokens": counts}
    rank = engine.rank
    engine.close()
if rank == 0:
    json.dump({**result, "after_close": is_deepspeed_zero3_enabled()}, open(out, "w"))
