"""Data the way Hugging Face users bring it (parallel/engine/data/loaders.py), with real `datasets` and
`transformers` objects built locally: a tokenizer from a word list, a padding collator returning
BatchEncoding, map-style and iterable (streaming-style) datasets. Each rank's share is built as that
rank would build it (dp_rank 0 and 1 of 2), so the union and the order are checked in one process."""

import pytest
import torch
from torch.utils.data import IterableDataset

from parallel.engine.data.guard import batch_problem
from parallel.engine.data.loaders import (
    DataChanged,
    IterableLoader,
    Loaders,
    build_loader,
    plain_batch,
)

WORDS = [f"w{i}" for i in range(40)]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def texts(n=24):
    g = torch.Generator().manual_seed(0)
    return [" ".join(WORDS[j] for j in torch.randint(0, 40, (int(k),), generator=g).tolist())
            for k in torch.randint(2, 9, (n,), generator=g)]


def tokenized(n=24):
    import datasets

    tok = tokenizer()
    ds = datasets.Dataset.from_dict({"text": texts(n), "idx": list(range(n))})
    return tok, ds.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])


def loader(ds, rank, size=2, world=2, **kw):
    return build_loader(ds, size=size, dp_size=world, dp_rank=rank, seed=0, shuffle=False,
                        collate_fn=kw.pop("collate_fn", None), drop_last=True,
                        device_loader=lambda x: x, **kw)


def test_map_style_hf_dataset_with_a_padding_collator():
    from transformers import BatchEncoding, DataCollatorWithPadding

    tok, ds = tokenized()
    collate = DataCollatorWithPadding(tok, return_tensors="pt")
    firsts = [next(iter(loader(ds, r, collate_fn=collate))) for r in (0, 1)]
    assert all(isinstance(b, BatchEncoding) for b in firsts)
    batch = plain_batch(firsts[0])
    assert type(batch) is dict and batch_problem(batch, None, 2)[0] is None
    # the ranks' first batches together are the global batch's samples, each once
    assert sorted(i for b in firsts for i in b["idx"].tolist()) == [0, 1, 2, 3]


def test_a_text_column_is_refused_naming_the_fix():
    problem, _ = batch_problem({"input_ids": torch.ones(2, 3), "text": ["a", "b"]}, None, 2)
    assert "['text'] are not tensors" in problem and "remove_columns" in problem and \
        "with_format('torch'" in problem


@pytest.mark.parametrize("kind", ["hf-odd-shards", "hf-whole-shards", "torch"])
def test_iterable_datasets_are_sharded_and_resume_exactly(kind):
    import datasets

    _, ds = tokenized()
    ds = ds.select_columns(["idx"]).with_format("torch")
    if kind == "torch":
        class Stream(IterableDataset):
            def __iter__(self):
                return ({"idx": torch.tensor(i)} for i in range(24))
        source = Stream()
    else:  # a streaming-style Hugging Face IterableDataset (local, no hub)
        source = ds.to_iterable_dataset(num_shards=3 if kind == "hf-odd-shards" else 4)
        assert isinstance(source, datasets.IterableDataset)
    seen = []
    for rank in (0, 1):
        whole = [b["idx"].tolist() for b in loader(source, rank)]
        seen += [i for b in whole for i in b]
        first = loader(source, rank)
        it = iter(first)
        taken = [next(it)["idx"].tolist() for _ in range(2)]
        assert taken == whole[:2]
        state = first.state_dict()
        again = loader(source, rank)
        again.load_state_dict(state)
        assert [b["idx"].tolist() for b in again] == whole[2:], (kind, rank)
    assert sorted(seen) == list(range(24))  # every sample once over the two ranks


def test_a_changed_dataset_is_named_on_resume_unless_accepted():
    _, ds = tokenized(24)
    _, other = tokenized(20)
    state = loader(ds, 0).state_dict()
    with pytest.raises(DataChanged, match="accept_changed_data=True"):
        loader(other, 0).load_state_dict(state)
    accepting = loader(other, 0)
    accepting.accept_changed = True
    accepting.load_state_dict(state)


def test_workers_with_an_iterable_dataset_are_refused_with_the_reason():
    _, ds = tokenized()
    with pytest.raises(ValueError, match="num_workers=0"):
        loader(ds.to_iterable_dataset(), 0, num_workers=2)


def test_eval_loaders_stay_out_of_the_checkpoint_and_loaders_go_by_name():
    _, ds = tokenized()
    ds = ds.select_columns(["idx"]).with_format("torch")
    loaders, said = Loaders(), []
    train = loaders.add(loader(ds, 0), None, False, False)
    loaders.add(loader(ds, 0), None, True, False)  # eval: never saved
    assert list(loaders.state_dict()) == ["loader0"]
    next(iter(train))
    state = loaders.state_dict()
    fresh = Loaders()
    fresh.add(loader(ds, 0), None, True, False)  # an eval loader added after the checkpoint
    resumed = fresh.add(loader(ds, 0), None, False, False)
    fresh.add(loader(ds, 0), "extra", False, False)  # a new training loader: starts fresh, said
    fresh.load_state_dict(state, said.append)
    assert resumed.batches_done == 1 and any("'extra' is not in the checkpoint" in s for s in said)
    old_format = Loaders()
    old_format.add(loader(ds, 0), None, False, False)
    old_format.load_state_dict([state["loader0"]], said.append)  # checkpoints before names
    assert old_format.train["loader0"].batches_done == 1
    assert isinstance(loader(ds.to_iterable_dataset(), 0), IterableLoader)


def test_an_hf_job_trains_on_batch_encodings_and_evaluates_token_weighted(tmp_path):
    """One process (FSDP2 at world size 1): a padded causal-LM collator's BatchEncoding trains, and
    evaluate() gives the token-weighted loss (not a mean of batch means) and its perplexity, with a
    metric through the hook; the eval loader is not in the checkpoint."""
    import math

    from transformers import DataCollatorForLanguageModeling

    from parallel import create_engine, load_spec
    from parallel.engine.infer.evaluate import token_accuracy
    from parallel.toy import build_llama, llama_config

    tok, ds = tokenized(24)
    ds = ds.remove_columns(["idx"])
    collate = DataCollatorForLanguageModeling(tok, mlm=False, return_tensors="pt")
    engine = create_engine(load_spec({"backend": "fsdp", "micro_batch_size": 2,
                                      "grad_accum_steps": 2}))
    torch.manual_seed(0)
    model = engine.prepare(build_llama(llama_config("tiny")), (torch.optim.SGD, {"lr": 0.1}))
    train = engine.dataloader(ds, collate_fn=collate)
    evals = engine.dataloader(ds, batch_size=5, shuffle=False, collate_fn=collate, eval=True)
    assert engine.train_step(next(iter(train))).loss > 0
    got = engine.evaluate(evals, metrics=[token_accuracy])
    total = tokens = right = 0.0
    with torch.no_grad():
        for batch in evals:
            out = model(**dict(batch))
            n = (batch["labels"][:, 1:] != -100).sum().item()
            total, tokens = total + out.loss.item() * n, tokens + n
            right += token_accuracy(out, dict(batch))["token_accuracy"].item()
    assert got["batches"] == 5  # 24 samples in batches of 5, the last one short: nothing dropped
    assert abs(got["loss"] - total / tokens) < 1e-6 and got["perplexity"] == math.exp(got["loss"])
    assert abs(got["token_accuracy"] - right / tokens) < 1e-9
    assert list(engine.trainer_state()["loaders"]) == ["loader0"]
    # a pass cut short does not make the next one start in the middle
    assert engine.evaluate(evals, max_batches=2)["batches"] == 2
    assert engine.evaluate(evals, metrics=[token_accuracy]) == got


def test_eval_loaders_read_every_sample_once_and_count_their_batches():
    _, ds = tokenized(9)
    ds = ds.select_columns(["idx"]).with_format("torch")
    shares = [build_loader(ds, size=2, dp_size=2, dp_rank=r, seed=0, shuffle=True,
                           collate_fn=None, drop_last=False, device_loader=lambda x: x, eval_=True)
              for r in (0, 1)]
    seen = [[i for b in share for i in b["idx"].tolist()] for share in shares]
    assert sorted(seen[0] + seen[1]) == list(range(9))  # uneven shares: 5 and 4, none dropped
    assert [len(s) for s in shares] == [3, 2] and shares[1].lockstep == 3
    with pytest.raises(ValueError, match="the last rank gets no batch"):
        build_loader(ds, size=5, dp_size=2, dp_rank=0, seed=0, shuffle=False, collate_fn=None,
                     drop_last=True, device_loader=lambda x: x, eval_=True)
