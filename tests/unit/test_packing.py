"""Document packing (parallel/engine/data/packing.py): a packed batch gives the loss and gradients of
its documents run one by one (1e-6) with eager and sdpa attention, trained through the engine too;
rows keep documents whole; the plan is best-fit; streams (torch's and Hugging Face's) resume exactly
from the document read ahead."""

import re

import pytest
import torch
from torch.utils.data import IterableDataset

from parallel import create_engine, load_spec
from parallel.engine.data import packing
from parallel.engine.data.loaders import build_loader
from parallel.toy import build_llama, llama_config


def documents(n=12, seed=0, longest=14):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(n):
        ids = torch.randint(3, 200, (int(torch.randint(2, longest, (1,), generator=g)),),
                            generator=g).tolist()
        labels = list(ids)
        if i % 3 == 0:  # an SFT document: its prompt is not a target
            labels[:len(ids) // 2] = [-100] * (len(ids) // 2)
        docs.append({"input_ids": ids, "labels": labels})
    return docs


def one_by_one(model, docs):
    """The mean over every target token of the documents, each run alone (HF's own loss sums)."""
    total, count = 0.0, 0
    for d in docs:
        ids, labels = torch.tensor([d["input_ids"]]), torch.tensor([d["labels"]])
        logits = model(input_ids=ids).logits[0, :-1].float()
        targets = labels[0, 1:]
        total = total + torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
        count += int((targets != -100).sum())
    return total / count


def packed(model, docs, n, mode):
    rows = [packing.make_row([packing.document(d) for d in group], n, 0)
            for group in ([docs[i] for i in row] for row in packing.plan_rows(
                [len(d["input_ids"]) for d in docs], n))]
    batch = packing.collate(mode)(rows)
    return model(**batch).loss, batch


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_packed_batch_is_its_documents_one_by_one(impl):
    torch.manual_seed(0)
    model = build_llama(llama_config("tiny"))
    model.config._attn_implementation = impl
    docs = documents()
    mode = packing.mask_mode(packing.attention_of(model), "fp32")
    assert mode == {"eager": "float32", "sdpa": "bool"}[impl]
    loss, batch = packed(model, docs, 24, mode)
    assert batch["input_ids"].shape[0] < len(docs)  # documents share rows
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = one_by_one(model, docs)
    reference.backward()
    assert abs(loss.item() - reference.item()) < 1e-6, (loss.item(), reference.item())
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, atol=1e-6, rtol=0), n


def test_rows_keep_documents_whole_and_the_plan_is_best_fit():
    lengths = [7, 5, 4, 3, 3, 2, 9, 1]
    rows = packing.plan_rows(lengths, 10)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 10 for r in rows)
    assert len(rows) == 4  # 34 tokens: 4 rows of 10 is the fewest
    assert packing.plan_rows([12, 3], 10) == [[0], [1]]  # a longer document: a row of its own (cut)
    row = packing.make_row([([5, 6, 7], [5, 6, 7]), ([8, 9], [-100, 9])], 7, 0)
    assert row["labels"].tolist() == [-100, 6, 7, -100, 9, -100, -100]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1]
    mask = packing.collate("bool")([row])["attention_mask"][0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False]


class Stream(IterableDataset):
    def __init__(self, docs):
        self.docs = docs

    def __iter__(self):
        return iter(self.docs)


def take(loader, k):
    it = iter(loader)
    return [next(it) for _ in range(k)]


@pytest.mark.parametrize("kind", ["torch", "hf"])
def test_a_packed_stream_resumes_exactly(kind):
    docs = documents(100, seed=1)
    said = []
    if kind == "hf":
        import datasets

        source = datasets.Dataset.from_list(docs).to_iterable_dataset(num_shards=2)
    else:
        source = Stream(docs)

    def make():
        return build_loader(source, size=2, dp_size=2, dp_rank=1, seed=0, shuffle=False,
                            collate_fn=packing.collate("bool"), drop_last=True,
                            device_loader=lambda x: x, pack=packing.Packer(16, 0, said.append))

    first = make()
    whole = [b["input_ids"] for b in take(make(), 5)]
    take(first, 2)
    state = first.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    after = [b["input_ids"] for b in take(resumed, 3)]
    assert all(torch.equal(a, b) for a, b in zip(after, whole[2:])), "resume is not exact"


def test_a_map_style_packed_loader_says_what_it_cut_and_trains(tmp_path):
    docs = documents(30, seed=2, longest=40)
    engine = create_engine(load_spec({"backend": "fsdp", "micro_batch_size": 2}))
    try:
        torch.manual_seed(0)
        model = build_llama(llama_config("tiny"))
        model.config._attn_implementation = "eager"
        engine.prepare(model, (torch.optim.SGD, {"lr": 0.0}))
        said = []
        engine.say = said.append
        loader = engine.dataloader(docs, pack_to=24, shuffle=False)
        assert any("were cut to 24 tokens" in s for s in said), said
        batch = next(iter(loader))
        result = engine.train_step(batch)
        rows = loader.loader.dataset
        group = [docs[i] for r in rows.rows[:2] for i in r]
        cut = [{k: v[:24] for k, v in d.items()} for d in group]
        with torch.no_grad():
            reference = one_by_one(model, cut)
        assert abs(result.loss - reference.item()) < 1e-6
        with pytest.raises(ValueError, match="pack_to and collate_fn together"):
            engine.dataloader(docs, pack_to=24, collate_fn=lambda x: x)
        # rows whose N x N masks exceed the host's memory: refused up front, naming the fix (#65)
        with pytest.raises(ValueError, match=r"pack_to=16,777,216.*GiB, beyond this host's memory"
                                             r".*flash_attention_2"):
            engine.dataloader(docs, pack_to=1 << 24)
    finally:
        engine.close()


def test_flattened_batches_train_each_document_alone_or_are_refused():
    """transformers' DataCollatorWithFlattening (documents side by side, position ids restarting,
    no mask): a Llama under sdpa confines them once the forward passes use_cache=False (with a cache
    transformers skips finding the documents: 1.2e-2 off); Qwen2-MoE, whose mask code does not find
    them, is refused naming the fixes."""
    import transformers
    from transformers import DataCollatorWithFlattening

    from parallel.engine.model.wrap import forward_kwargs
    from parallel.engine.data.packing import confines_flattened, flattened_problem
    from parallel.toy import build_llama, llama_config

    torch.manual_seed(0)
    model = build_llama(llama_config("tiny"))
    model.config._attn_implementation = "sdpa"
    docs = [torch.randint(0, 200, (n,)).tolist() for n in (5, 9, 4, 7)]
    batch = DataCollatorWithFlattening()([{"input_ids": d} for d in docs], return_tensors="pt")
    alone = [(model(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss.item(), len(d) - 1)
             for d in docs]
    expected = sum(loss * n for loss, n in alone) / sum(n for _, n in alone)
    kwargs = forward_kwargs(model, router=False)
    assert kwargs.of(dict(batch)) == {**batch, "use_cache": False}
    ids = {"input_ids": batch["input_ids"]}  # no position ids: the model's own default, no reads
    assert kwargs.of(ids) == ids
    assert model(**kwargs.of(dict(batch))).loss.item() == pytest.approx(expected, abs=1e-6)
    assert abs(model(**batch).loss.item() - expected) > 1e-3  # the cache transformers makes itself
    assert confines_flattened(model) and "pack_to" in flattened_problem(dict(batch))
    moe = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=256, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
        shared_expert_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4))
    # transformers 5's Qwen2-MoE builds its mask with masking_utils (4.57's did not): it confines
    # each document too, as its loss on the flattened batch shows
    alone = [(moe(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss.item(), len(d) - 1)
             for d in docs]
    flat = moe(**forward_kwargs(moe, False).of(dict(batch))).loss.item()
    truth = flat == pytest.approx(sum(loss * n for loss, n in alone) / sum(n for _, n in alone),
                                  abs=1e-6)
    assert confines_flattened(moe) is truth is True
    assert flattened_problem({**batch, "attention_mask": torch.ones_like(batch["input_ids"])}) is None
    rows = {"input_ids": batch["input_ids"], "position_ids": torch.arange(25)[None]}
    assert flattened_problem(rows) is None  # one document a row


@pytest.mark.parametrize("doc,said", [
    ({"input_ids": ["5", "6"]}, "document 0's input_ids holds str '5'"),
    ({"input_ids": [1, None]}, "holds NoneType"),
    ({"input_ids": [[1, 2], [3]]}, "holds list"),
    ({"input_ids": [1.0, 2.7]}, "holds float '1.0'"),
    ({"input_ids": [1, 2 ** 70]}, "outside the vocabulary (0 to 255)"),
    ({"input_ids": [1, 256]}, "holds 256, outside the vocabulary"),
    ({"input_ids": [1, 2], "labels": [-100, -5]}, "labels holds -5"),
    ({"input_ids": torch.tensor([1.0, 2.0])}, "a torch.float32 tensor"),
    ({"input_ids": "hello"}, "input_ids str 'hello'"),
    ({"text": "hello"}, "document 0 has no input_ids"),
])
def test_hostile_documents_are_refused_naming_their_index(doc, said):
    """Packed documents from a stranger's dataset (#65): every id a whole number in the model's
    vocabulary, labels also -100; a float was truncated silently, None and nested lists were
    tracebacks."""
    from parallel.engine.data.documents import document

    assert document({"input_ids": [1, 2], "labels": [-100, 2]}, 0, 256) == ([1, 2], [-100, 2])
    with pytest.raises(ValueError, match=re.escape(said)):
        packing.PackedRows([doc], 8, 0, lambda line: None, vocab=256)
