"""Load each of several imported checkpoints of the 56M Llama into FSDP2 at this launch's ranks, with
its optimizer state, and record, per checkpoint, a digest of every byte this rank holds (parameters
and AdamW state) and the loss of one more step: equal records are equal states."""

import argparse
import json
from pathlib import Path

import xxhash
from native_worker import model_and_batches
from parity_worker import optimizer_arg

from parallel import create_engine, load_spec


def record(path: Path) -> tuple[int, dict]:
    engine = create_engine(load_spec({"backend": "fsdp", "topology": {"procs_per_node": 2},
                                      "micro_batch_size": 2}))
    model, batches = model_and_batches("56m")
    engine.prepare(model, optimizer_arg("adamw"))
    engine.load(path)
    digest = xxhash.xxh3_128()
    for p in engine.model.parameters():
        digest.update(p.detach().to_local().contiguous().numpy().tobytes())
        for value in engine.optimizer.state[p].values():
            value = value.to_local() if hasattr(value, "to_local") else value
            digest.update(value.detach().contiguous().numpy().tobytes())
    rows = engine.samples_per_step
    ids = batches[3][engine.dp_rank * rows:(engine.dp_rank + 1) * rows]
    out = {"step": engine.step, "digest": digest.hexdigest(),
           "loss": engine.train_step({"input_ids": ids, "labels": ids}).loss}
    rank = engine.rank
    engine.close()  # the next checkpoint's engine joins a fresh process group
    return rank, out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--paths", required=True, help="comma-separated checkpoints")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    results, rank = {}, 0
    for path in args.paths.split(","):
        rank, results[path] = record(Path(path))
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
