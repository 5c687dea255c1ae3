"""Tracking on every case of one launch group: each case trains 4 steps with `tracking.every: 2`,
logs a metric of its own and an evaluation, through the trackers the case lists, then closes its
trackers. Every rank records the StepResults it saw (the test compares them with what was logged) and
the progress bar's plain lines."""

import argparse
import json
import traceback
from pathlib import Path

import torch

from parallel import create_engine, load_spec
from parallel.toy import ByteDataset, build_llama, llama_config


def run_case(case: dict, out_dir: Path) -> dict:
    tracking = {"to": case["to"], "dir": str(out_dir), "every": 2, "run_name": case["name"],
                "peak_tflops": 1.0}
    spec = load_spec({**case["spec"], "tracking": tracking, "grad_clip": 1.0})
    engine = create_engine(spec)
    torch.manual_seed(0)
    engine.prepare(lambda: build_llama(llama_config("tiny")), (torch.optim.AdamW, {"lr": 1e-3}))
    data = ByteDataset(seq_len=32)
    batches = iter(engine.dataloader(data))
    record = {"rank": engine.rank, "steps": {}}
    with engine.progress_bar(total=4) as bar:
        for _ in range(4):
            result = engine.train_step(next(batches))
            bar.update(result)
            record["steps"][result.step] = {"loss": result.loss, "lr": result.lr,
                                            "grad_norm": result.grad_norm,
                                            "targets": result.targets}
    record["bar"] = bar.lines
    engine.log({"user/answer": 42.0})
    evaluation = engine.evaluate(engine.dataloader(torch.utils.data.Subset(data, range(8)),
                                                   eval=True))
    record["eval_loss"] = evaluation["loss"]
    engine.tracker.close()  # what engine.close() does first; the process group stays for the next
    engine.barrier()  # case (a closed engine's group is not re-made in one process)
    return record


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results, rank = {}, 0
    for case in json.loads(Path(args.cases).read_text()):
        try:
            results[case["name"]] = record = run_case(case, Path(args.out))
            rank = record["rank"]
        except Exception:  # noqa: BLE001 - recorded per case; the test names it
            results[case["name"]] = {"error": traceback.format_exc()[-3000:]}
    Path(args.out, f"records.rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
