"""topology.cp's split of a micro-batch and its checks at prepare (parallel/engine/model/
context_parallel.py), in one process: which tokens, labels, positions and mask each rank of a cp group
keeps. The all-to-all attention itself runs in tests/distributed/test_cp.py against one process."""

import pytest
import torch

from parallel.engine.model.context_parallel import NAME, ContextParallel, kv_repeat
from parallel.toy import build_llama, llama_config


def llama(**overrides):
    torch.manual_seed(0)
    return build_llama(llama_config("tiny", **overrides))


def make(cp=2, rank=0, tp=1, said=None, **overrides):
    return ContextParallel(llama(**overrides), cp, rank, tp,
                           (said if said is not None else []).append)


def test_each_rank_keeps_its_slice_with_labels_shifted_before_the_split():
    ids = torch.arange(16).reshape(2, 8)
    labels = ids.clone()
    labels[1, 6:] = -100  # a padded row: its second half holds one target
    parts = [make(rank=r).shard({"input_ids": ids, "labels": labels}) for r in (0, 1)]
    # rank 0's last token predicts rank 1's first: that target is on rank 0
    assert parts[0]["shift_labels"].tolist() == [[1, 2, 3, 4], [9, 10, 11, 12]]
    assert parts[1]["shift_labels"].tolist() == [[5, 6, 7, -100], [13, -100, -100, -100]]
    assert torch.equal(parts[1]["labels"], parts[1]["shift_labels"])  # the model needs labels
    assert parts[1]["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert parts[1]["position_ids"].tolist() == [[4, 5, 6, 7]] * 2  # global positions
    assert all(p["shift_labels"].is_contiguous() for p in parts)
    # together, the targets one process's loss sees (labels[:, 1:] != -100)
    kept = sum(int((p["shift_labels"] != -100).sum()) for p in parts)
    assert kept == int((labels[:, 1:] != -100).sum())


def test_a_row_cp_does_not_divide_is_padded_at_its_end_and_said_once():
    said = []
    cp = make(cp=4, rank=3, said=said, num_key_value_heads=4)
    ids = torch.arange(10)[None]
    out = cp.shard({"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})
    # 10 -> 12 tokens: rank 3 holds positions 9, 10, 11; padding is no target
    assert out["input_ids"].tolist() == [[9, 0, 0]]
    assert out["position_ids"].tolist() == [[9, 10, 11]]
    assert out["shift_labels"].tolist() == [[-100, -100, -100]]
    # an all-ones mask stays None at full length (causal alone is exact, as HF's sdpa path does)
    assert "attention_mask" not in out
    cp.shard({"input_ids": ids})
    assert len(said) == 1 and "padded to 12" in said[0]


def test_a_padding_mask_becomes_the_whole_rows_mask():
    ids = torch.arange(8)[None].repeat(2, 1)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 6:] = 0
    out = make(rank=1).shard({"input_ids": ids, "attention_mask": mask})
    full = out["attention_mask"]
    assert full.shape == (2, 1, 8, 8) and full.dtype == torch.bool
    assert bool(full[0, 0, 7, 5]) and not bool(full[0, 0, 7, 6])  # padded keys masked
    assert not bool(full[1, 0, 3, 4])  # causal


def test_what_cannot_be_split_is_refused_naming_the_fix():
    cp = make()
    with pytest.raises(ValueError, match="pack_to a multiple of 2"):
        cp.shard({"input_ids": torch.zeros(1, 5, dtype=torch.long),
                  "attention_mask": torch.ones(1, 1, 5, 5, dtype=torch.bool)})
    with pytest.raises(ValueError, match=r"\['token_type_ids'\]"):
        cp.shard({"input_ids": torch.zeros(1, 4, dtype=torch.long),
                  "token_type_ids": torch.zeros(1, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match="inputs_embeds"):
        cp.shard({"inputs_embeds": torch.zeros(1, 4, 32)})


def test_heads_and_attention_are_checked_at_prepare_with_the_numbers():
    # Llama-3-8B at tp 8 x cp 4: one key/value head per rank, repeated 4 times
    assert kv_repeat(llama_config("tiny", num_attention_heads=32, num_key_value_heads=8), 8,
                     4) == (4, None)
    assert make(cp=2, tp=2).kv_repeat == 2 and make(cp=2).kv_repeat == 1
    with pytest.raises(ValueError, match="num_attention_heads 4 / tp 1 = 4 heads per rank, "
                       "which cp 3 does not divide"):
        make(cp=3)
    model = llama()
    model.config._attn_implementation_internal = "flex_attention"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        ContextParallel(model, 2, 0, 1, print)


def test_the_model_attends_through_ulysses_except_for_whole_rows():
    model = llama(attn_implementation="sdpa")
    cp = ContextParallel(model, 2, 0, 1, print)
    assert model.config._attn_implementation == NAME
    assert cp.marked == model.config.num_hidden_layers  # every attention module found
    with cp.plain():  # generation and a direct call: the model's own attention, whole rows
        assert model.config._attn_implementation == "sdpa"
        model(input_ids=torch.arange(6)[None])
    assert model.config._attn_implementation == NAME


def test_token_accuracy_over_the_ranks_slices_is_the_whole_rows():
    """evaluate's metric on each rank's slice (shift_labels, logits of its tokens), summed over the
    cp group as evaluate sums it, equals the metric on whole rows."""
    from types import SimpleNamespace

    from parallel.engine.infer.evaluate import token_accuracy

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5, (2, 8), generator=g)
    labels = ids.clone()
    labels[1, 6:] = -100
    logits = torch.randn(2, 8, 5, generator=g)
    whole = token_accuracy(SimpleNamespace(logits=logits), {"labels": labels})
    parts = [make(rank=r).shard({"input_ids": ids, "labels": labels}) for r in (0, 1)]
    sliced = [token_accuracy(SimpleNamespace(logits=logits[:, 4 * r:4 * (r + 1)]), p)
              for r, p in enumerate(parts)]
    for key in whole:
        assert int(whole[key]) == sum(int(s[key]) for s in sliced), key
