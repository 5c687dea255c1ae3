"""Peak extra host memory of each rank during save and during load (issue #16): a ~24M-parameter
Llama with AdamW, one step, then save and load while a thread samples this process's resident set
every millisecond; every spec of --specs in turn, each engine closed before the next. Rank 0 writes
every rank's figures to --out."""

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from parallel import create_engine, load_spec
from parallel.checkpoint.hf import hf_gather
from parallel.toy import build_llama, llama_config

# save_pretrained's segments, as hf_gather's 16 MiB stand to a model 16x larger: a rank's share here
# (47 MB at 2 ranks) is written in many segments
SEGMENT_BYTES = 1 << 20
SIZE = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def rss() -> int:
    """Resident anonymous memory (RssAnon): what a save or load holds. Pages of a checkpoint file
    mapped to hash it (parallel/checkpoint/format/directory.py) are page cache, counted as RssFile and
    evictable at any time; the whole resident set would count them."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class Peak:
    """The highest resident set seen while the block runs, above what it was at the start."""

    def __enter__(self):
        self.start, self.peak, self.done = rss(), 0, False
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.done = True
        self.thread.join()
        self.extra = max(self.peak, rss()) - self.start


def trim() -> None:
    """Freed memory back to the system before a measurement (the collector, then glibc's heap), so
    what a save or load allocates shows as growth even where an earlier job or step freed as much
    (the allocator would otherwise hand it back unseen)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure(spec_dict: dict, root: Path) -> dict:
    engine = create_engine(load_spec(spec_dict))
    torch.manual_seed(0)
    model = build_llama(llama_config("demo", **SIZE))
    params = sum(p.numel() for p in model.parameters())
    engine.prepare(model, (torch.optim.AdamW, {"lr": 1e-3}))
    rows = engine.samples_per_step
    ids = torch.randint(0, 256, (rows * engine.world_size, 16),
                        generator=torch.Generator().manual_seed(1))
    mine = ids[engine.dp_rank * rows:(engine.dp_rank + 1) * rows]
    before = engine.train_step({"input_ids": mine, "labels": mine}).loss
    dist.barrier()
    trim()
    with Peak() as save:
        engine.save(root)
    dist.barrier()
    trim()
    with Peak() as load:
        engine.load(root)
    trim()
    hf_gather.SEGMENT_BYTES = SEGMENT_BYTES
    with Peak() as hf:  # save_pretrained written in place: two segments held
        engine.save_pretrained(root.parent / f"{root.name}-hf")
    trim()
    with Peak() as step:  # what a training step itself needs beyond the state (DeepSpeed's gathers)
        after = engine.train_step({"input_ids": mine, "labels": mine}).loss
    figures = [None] * engine.world_size
    dist.all_gather_object(figures, {"rank": engine.rank, "save": save.extra, "load": load.extra,
                                     "hf": hf.extra, "step": step.extra})
    out = {"params": params, "ranks": figures, "losses": [before, after],
           "world": engine.world_size}
    engine.close()  # the next job joins a fresh process group; this one's memory is freed
    del engine, model
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--specs", required=True, help="{name: spec}: measured one after another")
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    results = {name: measure(spec, Path(a.dir) / name)
               for name, spec in json.loads(a.specs).items()}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(a.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
