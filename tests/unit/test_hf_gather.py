"""save_pretrained's gathered path (#44 item 3, parallel/checkpoint/hf/hf_gather.py) in one process: the
safetensors writer gives safetensors' own bytes, a world-1 engine's files equal save_file of its model's
tensors byte for byte (a tied model, many files, many segments), blocks of any shape are written where
their chunk says, and a missing piece is refused. Every backend at 2 ranks, each writing into the
other's files: test_hf_job.py."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from parallel import create_engine, load_spec
from parallel.checkpoint.hf import hf_gather
from parallel.checkpoint.hf.hf_files import write_safetensors
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
    """A tied tiny Llama (its lm_head left out, as transformers saves it), bf16, in segments of 4 KB:
    every file holds what save_file writes of the model's own tensors, cast."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(hf_gather, "SEGMENT_BYTES", 4096)
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


@pytest.mark.parametrize("shape,offsets,sizes", [
    ((4, 6), (1, 0), (2, 6)),  # row block (FSDP2, ZeRO): one run
    ((4, 6), (0, 3), (4, 3)),  # column block (tensor parallel): a run per row
    ((3, 4, 5), (1, 2, 0), (2, 2, 5)),  # whole last dimension: a run per (i, j)
    ((3, 4, 5), (2, 1, 3), (1, 1, 2)),  # part of one row
    ((7,), (2,), (5,)), ((), (), ()), ((4, 6), (0, 0), (0, 6))])
def test_runs_are_the_blocks_elements_in_order(shape, offsets, sizes):
    """Oracle: the element indices of the block, read from an arange of the shape."""
    full = torch.arange(math.prod(shape)).view(shape)
    block = full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(-1)
    got = [i for at, n in hf_gather.runs(shape, offsets, sizes) for i in range(at, at + n)]
    assert got == block.tolist()
    if all(n == s for n, s in zip(sizes[1:], shape[1:])) and block.numel():
        assert len(hf_gather.runs(shape, offsets, sizes)) == 1  # a row block is one write


@pytest.mark.parametrize("durable,segment", [(False, 100), (True, 1 << 20)])
def test_blocks_written_in_place_in_any_order_give_the_tensors(tmp_path, monkeypatch, durable,
                                                               segment):
    """Column blocks of one tensor and row blocks of another, cast to bf16, written in any order
    into a file another writer made (in segments smaller than a block, or whole): safetensors reads
    back the tensors; a durable write of HINT_BYTES or more hands its whole pages, and only those,
    to the disk's writeback."""
    from safetensors.torch import load_file

    from parallel.checkpoint.state import state_files
    from parallel.checkpoint.format.directory import partial_path
    from parallel.checkpoint.hf.hf_files import SafetensorsFile, safetensors_layout

    calls = []
    monkeypatch.setattr(state_files, "sync_file_range", lambda: lambda *a: calls.append(a[1:]))
    monkeypatch.setattr(hf_gather, "SEGMENT_BYTES", segment)
    monkeypatch.setattr(hf_gather, "HINT_BYTES", 4096)
    full = {"a": torch.randn(40, 60), "b": torch.randn(6000)}
    layout = [(n, tuple(t.shape), torch.bfloat16) for n, t in sorted(full.items())]
    _, places, length = safetensors_layout(layout)
    made = SafetensorsFile(tmp_path / "m.safetensors", layout)
    made.allocate()
    blocks = [("b", (2000,), (4000,)), ("a", (0, 30), (40, 30)), ("b", (0,), (2000,)),
              ("a", (0, 0), (40, 30))]
    with hf_gather.InPlace([partial_path(tmp_path / "m.safetensors")], durable) as writer:
        for name, offsets, sizes in blocks:
            piece = full[name][tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].contiguous()
            writer.write(0, name, places[name], hf_gather.runs(full[name].shape, offsets, sizes),
                         piece, torch.bfloat16)
    made.close(durable)
    assert writer.counts == {"a": 2400, "b": 6000}
    loaded = load_file(tmp_path / "m.safetensors")
    assert all(torch.equal(loaded[n], t.to(torch.bfloat16)) for n, t in full.items())
    assert (tmp_path / "m.safetensors").stat().st_size == length
    # durable: b's 8,000-byte block alone reaches HINT_BYTES (a's rows are 60 bytes, b's first
    # block 4,000): the pages inside it; not durable: nothing
    start = places["b"] + 2000 * 2
    assert calls == ([(-(-start // 4096) * 4096, 4096, state_files.SYNC_FILE_RANGE_WRITE)]
                     if durable else [])


def test_a_missing_piece_is_refused():
    entries = [("a", (4, 6), None), ("b", (5,), None)]
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"b got 3 of its 5 elements"):
        hf_gather._agree(None, 1, cpu, None, {"a": 24, "b": 3}, entries)
    hf_gather._agree(None, 1, cpu, None, {"a": 24, "b": 5}, entries)
    with pytest.raises(OSError, match="full"):  # this rank's own error first
        hf_gather._agree(OSError("full"), 1, cpu, None, {"a": 24, "b": 5}, entries)
