"""`polyshard bench --seq A,B,... --budget GIB` (parallel/tools/bench/sweep.py): the lengths parse as a
sorted list, and a spec with cp gets the cp 1 layout beside it on the same ranks. The sweep itself
launches benches: tests/distributed/test_bench_plan.py runs one (make test-full)."""

import argparse

import pytest

from parallel.cli.args import seq_list
from parallel.spec.io import SpecError, load_spec
from parallel.tools.bench.sweep import layouts


def test_seq_takes_one_length_or_a_sweep():
    assert seq_list("64") == [64]
    assert seq_list("4096, 1024,2048,1024") == [1024, 2048, 4096]
    for bad in ("", "0", "1k", "2,-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            seq_list(bad)


def rows(spec) -> int:
    return spec.micro_batch_size * spec.grad_accum_steps * spec.dims.dp_size


def test_a_spec_with_cp_is_swept_beside_its_cp1_layout_on_the_same_global_batch():
    """cp 1 on the same ranks has cp times the data-parallel ranks: each takes 1/cp of the rows
    (it ran cp times the global batch, so cp 2 compared 2 rows a step against cp 1's 4)."""
    spec = load_spec({"backend": "fsdp", "micro_batch_size": 2, "global_batch_size": 4,
                      "topology": {"procs_per_node": 4, "cp": 2}})
    got = layouts(spec)
    assert list(got) == ["cp 1", "cp 2"] and got["cp 2"] is spec
    flat = got["cp 1"]
    assert (flat.world_size, flat.dims.dp_size, flat.topology.cp) == (4, 4, 1)
    assert rows(flat) == rows(spec) == 4 and flat.micro_batch_size == 1
    assert list(layouts(flat)) == ["cp 1"]
    accum = layouts(load_spec({"backend": "fsdp", "micro_batch_size": 1, "grad_accum_steps": 2,
                               "topology": {"procs_per_node": 4, "cp": 2}}))["cp 1"]
    assert accum.grad_accum_steps == 1 and rows(accum) == 4
    with pytest.raises(SpecError, match="micro_batch_size"):
        layouts(load_spec({"backend": "fsdp", "micro_batch_size": 1,
                           "topology": {"procs_per_node": 4, "cp": 2}}))


def test_bench_data_packs_a_users_documents_as_pack_to_does(tmp_path, monkeypatch):
    """`bench --data module:function` yielding tokenized documents (not batches): packed into rows
    of --seq tokens by polyshard's packer, with the masks the model's attention takes, so
    benchmarking one's own packed data needs no polyshard internals (#64)."""
    import types

    import torch

    from parallel.tools.bench.cell import batch_source
    from parallel.toy import build_llama, llama_config

    (tmp_path / "my_docs.py").write_text(
        "def documents(seed):\n"
        "    import random\n"
        "    rng = random.Random(seed)\n"
        "    while True:\n"
        "        n = rng.randint(3, 20)\n"
        "        yield {'input_ids': [rng.randrange(256) for _ in range(n)]}\n")
    monkeypatch.chdir(tmp_path)
    model = build_llama(llama_config("tiny"))
    model.config._attn_implementation = "sdpa"
    args = types.SimpleNamespace(data="my_docs:documents", global_rows=4, seq=32, warmup=1,
                                 steps=2)
    batches = batch_source(args, model, seed=0, precision="fp32")
    assert len(batches) == 3
    for b in batches:
        assert b["input_ids"].shape == (4, 32) and b["attention_mask"].shape == (4, 1, 32, 32)
        assert b["attention_mask"].dtype == torch.bool
        assert (b["position_ids"] == 0).sum() > 4  # several documents a row, positions restart
        assert (b["labels"] == -100).any()  # each document's first token is no target
