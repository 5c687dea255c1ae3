"""save_pretrained's gathered path (#44 item 3, parallel/checkpoint/hf_gather.py) in one process: the
safetensors writer gives safetensors' own bytes, a world-1 engine's files equal save_file of its model's
tensors byte for byte (a tied model, many files, many slices), pieces land where their chunk says and
a missing one is refused. Every backend at 2 ranks, pieces crossing ranks: test_hf_job.py."""

import json

import pytest
import torch
from safetensors.torch import save_file

from parallel import create_engine, load_spec
from parallel.checkpoint import hf_gather
from parallel.checkpoint.hf_files import shard_files, write_safetensors
from parallel.toy import build_llama, llama_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_writer_gives_safetensors_own_bytes(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=g).to(dtype) for name, shape in
               sorted({"b.weight": (3, 5), "a.bias": (7,), "z": (2, 2, 2), "s": (), "e": (0, 4)}.items())}
    save_file(tensors, str(tmp_path / "theirs"), metadata={"format": "pt"})
    write_safetensors(tmp_path / "ours", tensors)
    assert (tmp_path / "ours").read_bytes() == (tmp_path / "theirs").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours", "theirs"]  # no .partial left


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000])
def test_a_one_rank_save_is_save_files_bytes(tmp_path, monkeypatch, max_shard_bytes):
    """A tied tiny Llama (its lm_head left out, as transformers saves it), bf16, in slices of 4 KB:
    every file holds what save_file writes of the model's own tensors, cast."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(hf_gather, "SLICE_BYTES", 4096)
    torch.manual_seed(0)
    model = build_llama(llama_config("tiny", tie_word_embeddings=True))
    engine = create_engine(load_spec({"backend": "fsdp", "micro_batch_size": 2, "precision": "bf16"}))
    try:
        engine.prepare(model, (torch.optim.AdamW, {"lr": 1e-2}))
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
        engine.train_step({"input_ids": ids, "labels": ids})  # weights of its own, not the seed's
        out = engine.save_pretrained(tmp_path / "hf", max_shard_bytes=max_shard_bytes)
        with engine.unwrap() as plain:  # the FSDP2 model's parameters, gathered whole
            state = {k: getattr(v, "full_tensor", lambda v=v: v)().detach().to(torch.bfloat16)
                     for k, v in plain.state_dict().items()}
    finally:
        engine.close()
    del state["lm_head.weight"]  # tied to the embedding
    if max_shard_bytes is None:
        files = {"model.safetensors": sorted(state)}
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(state)
        files = {}
        for name, file in index["weight_map"].items():
            files.setdefault(file, []).append(name)
        assert len(files) >= 2
    for file, names in files.items():
        save_file({n: state[n].contiguous() for n in sorted(names)}, str(tmp_path / "theirs"),
                  metadata={"format": "pt"})
        assert (out / file).read_bytes() == (tmp_path / "theirs").read_bytes(), file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "theirs"]  # nothing staged
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_slices_cut_each_file_in_order(monkeypatch):
    """Every file in the same number of slices; a file's tensors, by name, each in the slice its
    first byte falls in (a tensor larger than a slice alone in its own, the slices after it empty)."""
    sizes = [10, 3000, 5, 5, 700, 40, 2000]  # fp32: 23,040 bytes, one file
    weights = [(f"w{i:02d}", (n,), None) for i, n in enumerate(sizes)]
    monkeypatch.setattr(hf_gather, "SLICE_BYTES", 4000)
    where, rounds = hf_gather._slices(shard_files(weights, 4, None, 1), 4)
    assert rounds == 6  # ceil(23,040 / 4,000)
    assert [where[name] for name, _, _ in weights] == [(0, j, k) for j, k in
                                                      enumerate([0, 0, 3, 3, 3, 3, 3])]
    two = shard_files(weights, 4, 12_500, 1)  # w00-w03 | w04-w06: 12,080 and 10,960 bytes
    where, rounds = hf_gather._slices(two, 4)
    assert rounds == 4 and [where[name][::2] for name, _, _ in weights] == [
        (0, 0), (0, 0), (0, 3), (0, 3), (1, 0), (1, 1), (1, 1)]


def test_pieces_land_where_their_chunk_says_and_a_gap_is_refused():
    """Column blocks (a tensor-parallel split) and row blocks of two tensors, in any order."""
    full = {0: torch.arange(24.).view(4, 6), 1: torch.arange(5.)}
    shard = [("a", (4, 6), None), ("b", (5,), None)]
    part = hf_gather.Part([(0, (4, 6)), (1, (5,))], shard, torch.float32)
    part.land(0, (0, 3), (4, 3), full[0][:, 3:].contiguous())
    part.land(1, (2,), (3,), full[1][2:])
    part.land(0, (0, 0), (4, 3), full[0][:, :3].contiguous())
    with pytest.raises(RuntimeError, match=r"b got 3 of its 5 elements"):
        part.check()
    part.land(1, (0,), (2,), full[1][:2])
    part.check()
    assert all(torch.equal(part.views[j], full[j]) for j in full)
