"""The loop around the step, as a Hugging Face user writes it, on every case of one launch group.

save phase, per case: a tiny Llama (a copy kept in this process as the one-process reference);
  evaluate: a map-style `datasets.Dataset` and its streaming form (`to_iterable_dataset`), 9 rows of
  padded text through DataCollatorForLanguageModeling, 2 per batch: ranks get 3 and 2 batches;
  unwrap: the Hugging Face model's logits on this rank's prompts;
  generate: greedy on this rank's left-padded prompts, and sampling where rank 1 stops at its first
  token (every id is its EOS) while rank 0 runs on; on XLA the compiles of a second, longer call;
  packing: tokenized documents of 2-13 tokens, pack_to 16 (engine.dataloader): an evaluation and two
  training steps against the same documents run one by one on the reference (and an AdamW step);
  registered state: a shared object and a per-rank one, two training steps, a checkpoint.
load phase, per case: a fresh engine loads the checkpoint another case wrote (--sources) and
  reports what its registered objects hold afterwards.
"""

import argparse
import copy
import json
import time
import traceback
from pathlib import Path

import torch
from parity_worker import global_batches, optimizer_arg

from parallel import create_engine, load_spec
from parallel.engine.infer.evaluate import token_accuracy
from parallel.toy import build_llama, llama_config

ROWS = 9  # evaluation rows: 5 on rank 0, 4 on rank 1 at 2 per batch
PROMPTS = ["w1 w2 w3", "w4 w5 w6 w7 w8 w9", "w10", "w11 w12 w13 w14"]


class Tally:
    """A user's own state: plain tensors and numbers."""

    def __init__(self, value=0.0):
        self.total, self.count = torch.tensor([value]), 0

    def add(self, x: float) -> None:
        self.total += x
        self.count += 1

    def state_dict(self) -> dict:
        return {"total": self.total, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.count = state["total"].clone(), state["count"]

    def seen(self) -> list:
        return [float(self.total[0]), self.count]


def data():
    from tests.unit.test_loaders import tokenized
    from transformers import DataCollatorForLanguageModeling

    tok, ds = tokenized(ROWS)
    ds = ds.remove_columns(["idx"])
    return tok, ds, DataCollatorForLanguageModeling(tok, mlm=False, return_tensors="pt")


def engine_for(spec_dict):
    torch.manual_seed(0)
    model = build_llama(llama_config("tiny"))
    reference = copy.deepcopy(model).eval()
    engine = create_engine(load_spec(spec_dict))
    engine.prepare(model, optimizer_arg("adamw"))
    return engine, reference


def evaluate(engine, reference, out):
    tok, ds, collate = data()
    with torch.no_grad():
        whole = collate([ds[i] for i in range(ROWS)])
        outputs = reference(**whole)
        acc = token_accuracy(outputs, whole)
        out["ref_eval"] = {"loss": float(outputs.loss),
                           "token_accuracy": float(acc["token_accuracy"] / acc["token_accuracy/"])}
    for kind, dataset in (("map", ds), ("stream", ds.to_iterable_dataset(num_shards=1))):
        loader = engine.dataloader(dataset, batch_size=2, shuffle=False, collate_fn=collate,
                                   eval=True)
        out[f"eval_{kind}"] = engine.evaluate(loader, metrics=[token_accuracy])


def prompts(engine, tok):
    tok.padding_side = "left"
    enc = tok(PROMPTS, padding=True, return_tensors="pt")
    rows = slice(2 * engine.dp_rank, 2 * engine.dp_rank + 2) if engine.world_size > 1 else slice(0, 2)
    return enc["input_ids"][rows], enc["attention_mask"][rows]


def generate(engine, reference, out):
    tok, _, _ = data()
    ids, mask = prompts(engine, tok)
    try:
        with engine.unwrap() as model:
            logits = model(input_ids=ids.to(engine.device), attention_mask=mask.to(engine.device)
                           ).logits.cpu()
        out["unwrap_diff"] = float((logits - reference(input_ids=ids, attention_mask=mask).logits)
                                   .abs().max())
    except RuntimeError as err:
        out["unwrap_error"] = str(err)
    greedy = engine.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0)
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=6, pad_token_id=0,
                                  do_sample=False)
    out["greedy_equal"] = torch.equal(greedy, expected)
    out["greedy"], out["greedy_ref"] = greedy.tolist(), expected.tolist()
    torch.manual_seed(engine.rank)
    stop_at_once = list(range(256)) if engine.rank == 1 else 10_000
    sampled = engine.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True,
                              pad_token_id=0, eos_token_id=stop_at_once)
    out["sampled_new"] = sampled.shape[1] - ids.shape[1]
    if engine.device.type == "xla":  # compiles of two longer calls in the same width bucket
        import torch_xla.debug.metrics as met

        out["xla_new_compiles"] = []
        for tokens in (16, 24):
            compiles = met.metric_data("CompileTime")[0]
            start = time.perf_counter()
            engine.generate(ids, attention_mask=mask, max_new_tokens=tokens, pad_token_id=0)
            out["xla_per_token_s"] = (time.perf_counter() - start) / tokens
            out["xla_new_compiles"].append(met.metric_data("CompileTime")[0] - compiles)


def documents():
    from tests.unit.test_packing import documents as make

    return make(40, seed=3)


def one_by_one(model, docs) -> torch.Tensor:
    from tests.unit.test_packing import one_by_one as mean

    return mean(model, docs)


def packed(engine, reference, spec, out):
    """engine.dataloader(pack_to=16): evaluated on the job's engine, trained two steps on a fresh
    one (a step holds every batch to the first one's keys); the reference runs each step's
    documents one by one (the rows every rank read, rebuilt from the same plan)."""
    from parallel.engine.data.packing import PackedRows

    docs = documents()
    loader = engine.dataloader(docs, pack_to=16, shuffle=False, eval=True, batch_size=2)
    out["packed_eval"] = engine.evaluate(loader)["loss"]
    with torch.no_grad():
        out["packed_eval_ref"] = float(one_by_one(reference, docs))
    engine, reference = engine_for(spec)
    rows = PackedRows(docs, 16, 0, lambda _: None).rows
    per_step = engine.samples_per_step * max(engine.dp_size, 1)
    train = engine.dataloader(docs, pack_to=16, shuffle=False)
    model = copy.deepcopy(reference).train()
    cls, kwargs = optimizer_arg("adamw")
    optimizer = cls(model.parameters(), **kwargs)
    out["packed_losses"], out["packed_ref"] = [], []
    for step, batch in zip(range(2), train):
        out["packed_losses"].append(engine.train_step(batch).loss)
        step_docs = [docs[i] for r in rows[step * per_step:(step + 1) * per_step] for i in r]
        loss = one_by_one(model, step_docs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out["packed_ref"].append(float(loss))


def train_and_save(engine, root: Path, name: str, out):
    shared, mine = Tally(), Tally(100.0 * engine.rank)
    engine.register_for_checkpointing(shared, "tally")
    engine.register_for_checkpointing(mine, "mine", per_rank=True)
    rows = engine.samples_per_step
    for ids in global_batches(2, max(engine.dp_size, 1), rows):
        part = ids[engine.dp_rank * rows:(engine.dp_rank + 1) * rows]
        result = engine.train_step({"input_ids": part, "labels": part})
        shared.add(result.loss)
        mine.add(float(engine.rank))
    engine.save(root / name)
    out["tally"], out["mine"] = shared.seen(), mine.seen()
    # Hugging Face format in process, every rank its share of the files (small shards: several
    # files, so every rank writes some); from_pretrained in the test gives this loss back
    engine.save_pretrained(root / f"{name}-hf", max_shard_bytes=40_000)
    if engine.world_size == 2:
        out["hf_fault"] = hf_disk_full(engine, root / f"{name}-hf-full")
    out["alone_reload"] = reload_alone(engine, root / f"{name}-hf")
    batch = global_batches(1, 1, 2)[0]
    out["hf_batch"] = batch.tolist()
    out["hf_eval"] = engine.evaluate([{"input_ids": batch, "labels": batch}])["loss"]
    out["hf_step"] = engine.step


def reload_alone(engine, path: Path) -> dict:
    """The habit after training: rank 0 alone reloads what save_pretrained wrote, while the job
    lives (after a ZeRO-3 job transformers still saw ZeRO-3, so from_pretrained entered zero.Init's
    broadcast that no other rank joined: a hang). Inside engine.unwrap() transformers sees ZeRO-3
    (generate keeps ranks in step), outside it not."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    inside, refused = None, None  # XLA FSDP v1 refuses unwrap (generate() records why)
    try:
        with engine.unwrap() as model:
            inside = is_deepspeed_zero3_enabled()
            try:  # the library's own save_pretrained on a sharded model: refused, naming ours
                model.save_pretrained(path.parent / f"own-{engine.rank}")
            except RuntimeError as err:
                refused = str(err)
        assert "save_pretrained" not in vars(model)  # the model's own method is back
    except RuntimeError:
        pass
    out = {"inside_unwrap": inside, "after": is_deepspeed_zero3_enabled(), "own_save": refused}
    if engine.rank == 0:
        model = AutoModelForCausalLM.from_pretrained(path)
        out["params"] = sum(p.numel() for p in model.parameters())
    engine.barrier()
    return out


def hf_disk_full(engine, out: Path) -> dict:
    """save_pretrained where every write of rank 1 fails as on a full disk: what each rank raised
    (none may wait on the other: the test's launch is bounded) and what is left in the directory."""
    import errno
    import os
    from unittest import mock

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    error = None
    try:
        with mock.patch.object(os, "pwrite", full if engine.rank == 1 else os.pwrite):
            engine.save_pretrained(out, max_shard_bytes=40_000)
    except Exception as err:  # noqa: BLE001 - what this rank raised is the result
        error = f"{type(err).__name__}: {err}"
    engine.barrier()
    return {"error": error, "left": sorted(p.name for p in out.iterdir()) if out.exists() else []}


def load(engine, source: Path, out):
    shared, mine = Tally(-1.0), Tally(-1.0)
    engine.register_for_checkpointing(shared, "tally")
    engine.register_for_checkpointing(mine, "mine", per_rank=True)
    try:
        engine.load(source)
    except ValueError as err:  # per rank across world sizes: refused before anything is read
        out["load_error"] = str(err)
        engine.user_state.objects.pop("mine")  # the shared object alone still goes across
        engine.load(source)
    out["tally"], out["mine"] = shared.seen(), mine.seen()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True)
    ap.add_argument("--phase", choices=["save", "load"], required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    root, results, rank = Path(args.root), {}, 0
    for case in json.loads(Path(args.cases).read_text()):
        out = results[case["name"]] = {}
        try:
            if args.phase == "save":  # close() writes the weights in HF format (hf_at_end)
                at_end = {"dir": str(root / f"{case['name']}-run"), "hf_at_end": True}
                case["spec"] = {**case["spec"], "checkpoint": {
                    **case["spec"].get("checkpoint", {}), **at_end}}
            engine, reference = engine_for(case["spec"])
            rank = engine.rank
            out["world_size"] = engine.world_size
            if args.phase == "save":
                evaluate(engine, reference, out)
                generate(engine, reference, out)
                packed(engine, reference, case["spec"], out)
                train_and_save(engine, root, case["name"], out)
                engine.close()  # the next case joins a fresh process group
            else:
                load(engine, root / case["source"], out)
                engine.barrier()
        except Exception:  # noqa: BLE001 - recorded per case; the test names it
            out["error"] = traceback.format_exc()[-3000:]
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(results))  # every rank's view


if __name__ == "__main__":
    main()
