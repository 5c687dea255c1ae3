"""hf_files.write_hf: the weights split over the writing ranks (every part about one file), each
part writing only its own files, part 0 the index; the files hold the values and dtype asked for."""

import json

import torch
from safetensors.torch import load_file

from parallel.checkpoint.hf.hf_files import write_hf


def weights():
    torch.manual_seed(0)
    values = {f"layer.{i}.weight": torch.randn(10, 5 + i) for i in range(8)}
    return values, [(n, tuple(t.shape), lambda t=t: t) for n, t in values.items()]


def test_weights_are_split_over_the_parts_and_each_part_writes_its_own(tmp_path):
    values, entries = weights()
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    written = []
    for i in range(4):
        before = set(tmp_path.glob("*.safetensors"))
        write_hf(entries, dict(cfg), "bf16", tmp_path, None, (i, 4))
        written.append(set(tmp_path.glob("*.safetensors")) - before)
    assert all(len(files) == 1 for files in written), written  # every rank wrote one file
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = {f.name for f in tmp_path.glob("*.safetensors")}
    assert set(index["weight_map"].values()) == files and len(files) == 4, files
    assert index["metadata"]["total_size"] == 2 * sum(t.numel() for t in values.values())
    loaded = {}
    for f in files:
        loaded.update(load_file(tmp_path / f))
    assert set(loaded) == set(values)
    for name, t in values.items():
        assert loaded[name].dtype == torch.bfloat16 and torch.equal(loaded[name], t.bfloat16())
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_single_part_writes_one_file_when_it_fits(tmp_path):
    _, entries = weights()
    write_hf(entries, {"model_type": "llama"}, "fp32", tmp_path, None, (0, 1))
    assert [f.name for f in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_planted_links_are_replaced_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    names = ("config.json", "generation_config.json", "model.safetensors")
    for name in names:
        (out / name).symlink_to(victim)
    _, entries = weights()
    write_hf(entries, {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "fp32", out,
             None, (0, 1))
    assert victim.read_text() == "keep"
    assert not any((out / name).is_symlink() for name in names)
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # no temporary file left
