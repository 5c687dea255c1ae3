"""Steady-state step time of the same job eager and compiled, for docs/compile.md.

`polyshard bench --set compile=true` reports compile time and the compile counters; on a shared 2-core
host its medians from separate launches drift by 30-50% within minutes (docs/bench.md), so this loop
alternates eager and compiled launches of one backend back to back and prints each median:

    for b in "fsdp {}" "fsdp {'fsdp':{'version':1}}" "deepspeed {'shard':'grad_op'}" ...; do
      for c in False True; do torchrun --nproc-per-node 2 benchmarks/compile_ab.py $b $c; done
    done
"""

import statistics
import sys
import time

import torch

from parallel import create_engine, load_spec
from parallel.toy import build_llama, llama_config

backend, extra, compiled = sys.argv[1], eval(sys.argv[2]), sys.argv[3] == "True"
spec = load_spec({"backend": backend, "topology": {"procs_per_node": 2}, "micro_batch_size": 8,
                  "grad_clip": 1.0, "compile": compiled, **extra})
engine = create_engine(spec)
torch.manual_seed(0)
engine.prepare(build_llama(llama_config("demo")), (torch.optim.AdamW, {"lr": 1e-3}))
g = torch.Generator().manual_seed(1)
times = []
for step in range(15):
    ids = torch.randint(0, 256, (8, 64), generator=g)
    start = time.perf_counter()
    engine.train_step({"input_ids": ids, "labels": ids}).loss  # reads the loss: the step is done
    times.append(time.perf_counter() - start)
if engine.is_main:
    stats = engine.compile_stats()
    print(f"{backend} {extra} compile={compiled}: first step {times[0]:.2f} s, steady median "
          f"{statistics.median(times[3:]) * 1e3:.1f} ms" + (f", {stats.row()}" if stats else ""))
engine.close()
