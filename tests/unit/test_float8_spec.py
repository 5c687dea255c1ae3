"""precision: fp8's spec rules, the conversion's choices, and what plan counts for it (the training
itself: tests/distributed/test_float8.py)."""

import subprocess
import sys

import pytest
import torch

from parallel.engine.model.float8 import apply_float8, batch_split, kept
from parallel.spec.errors import SpecError
from parallel.spec.io import load_spec
from parallel.spec.precision import Float8
from parallel.toy import build_llama, llama_config

FP8 = {"precision": "fp8"}


def refused(data: dict) -> str:
    with pytest.raises(SpecError) as err:
        load_spec(data)
    return str(err.value)


def test_fp8_validates_where_it_trains():
    for data in ({"backend": "fsdp"}, {"backend": "fsdp", "fsdp": {"version": 1}},
                 *({"backend": "deepspeed", "shard": s} for s in ("none", "optimizer", "grad_op",
                                                                  "full"))):
        spec = load_spec({**data, **FP8})
        assert (spec.compute, spec.grad_reduce_dtype) == ("bf16", "fp32"), data
    assert load_spec({**FP8, "float8": {"base": "fp32"}}).compute == "fp32"
    assert load_spec({**FP8, "reduce_dtype": "compute"}).grad_reduce_dtype == "bf16"


def test_each_refusal_names_its_field():
    assert refused({"backend": "xla_fsdp", **FP8}).startswith("precision: 'fp8' is not supported "
                                                               "by backend 'xla_fsdp'")
    assert "float8: is read only with precision: fp8" in refused({"float8": {"recipe": "rowwise"}})
    rowwise = {**FP8, "float8": {"recipe": "rowwise", "all_gather": True}}
    assert "float8.all_gather: true with recipe 'rowwise'" in refused(rowwise)
    gather = {**FP8, "float8": {"all_gather": True}}
    assert "fsdp.version: 1" in refused({**gather, "fsdp": {"version": 1}})
    assert "shard: none" in refused({**gather, "shard": "none"})
    assert "float8.all_gather: true on deepspeed" in refused(
        {**gather, "backend": "deepspeed"})
    assert "keep_high_precision" in refused({**FP8, "float8": {"keep_high_precision": [""]}})


def test_a_full_dump_validates_again():
    """bench and parity hand each cell a full dump, which holds the float8 section's defaults."""
    for data in ({}, FP8, {**FP8, "float8": {"all_gather": True}}):
        spec = load_spec(data)
        assert load_spec(spec.model_dump(mode="json")) == spec


def test_the_cli_exits_2_naming_the_field(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("backend: xla_fsdp\nprecision: fp8\n")
    out = subprocess.run([sys.executable, "-m", "parallel.cli", "validate", str(cfg)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "precision" in out.stderr and "Traceback" not in out.stderr


def test_patterns_match_names_and_dotted_suffixes():
    patterns = list(Float8().keep_high_precision)
    assert kept("lm_head", patterns) and kept("base_model.model.lm_head", patterns)
    assert kept("model.layers.0.block_sparse_moe.gate", patterns)
    assert kept("model.layers.0.mlp.shared_expert_gate", patterns)
    assert not kept("model.layers.0.mlp.gate_proj", patterns)
    assert kept("model.layers.3.mlp.down_proj", ["layers.3.*"])


def test_the_conversion_keeps_heads_routers_and_small_layers():
    said = []
    llama = build_llama(llama_config("tiny"))
    done = apply_float8(llama, Float8(base="fp32"), torch.device("cpu"), said.append)
    assert len(done.converted) == 14 and done.kept == ["lm_head"] and done.emulated
    assert type(llama.model.layers[0].mlp.down_proj).__name__ == "Float8Linear"
    assert type(llama.lm_head) is torch.nn.Linear
    assert "14 linear layers in float8, 1 kept in fp32" in said[0] and "emulated" in said[0]
    from transformers import AutoModelForCausalLM

    # transformers 5's own Mixtral (the toy lists its experts): router and experts fused
    mixtral = AutoModelForCausalLM.from_config(llama_config("mixtral"), dtype=torch.float32)
    done = apply_float8(mixtral, Float8(), torch.device("cpu"), said.append)
    # transformers 5: the router (a TopKRouter) and the fused experts are no linear layers: the
    # attention's projections convert, and the experts are said to stay in the base precision
    assert done.kept == ["lm_head"] and all(".self_attn." in n for n in done.converted)
    assert "fused 3-D tensors" in said[-1] and "stay in bf16" in said[-1]
    odd = torch.nn.Sequential(torch.nn.Linear(32, 24), torch.nn.Linear(24, 32))
    with pytest.raises(SpecError, match="converted no layer"):
        apply_float8(odd, Float8(), torch.device("cpu"), said.append)


def test_tensorwise_says_where_its_scales_are_not_one_processs():
    said = []
    apply_float8(build_llama(llama_config("tiny")), Float8(), torch.device("cpu"), said.append,
                 "dp 2 x 2 micro-batches")
    assert "over the tensor this rank computes (dp 2 x 2 micro-batches)" in said[-1]
    said.clear()
    apply_float8(build_llama(llama_config("tiny")), Float8(recipe="rowwise"), torch.device("cpu"),
                 said.append, "dp 2")
    # rowwise: each row's own scale forward, but the weight gradient's per-feature scales are
    # over this rank's tokens (measured 3.6e-4 under a split, docs/precision.md)
    assert len(said) == 2 and "rowwise casts each weight gradient" in said[-1] and "(dp 2)" in said[-1]
    said.clear()
    apply_float8(build_llama(llama_config("tiny")), Float8(recipe="rowwise_with_gw_hp"),
                 torch.device("cpu"), said.append, "dp 2")
    assert len(said) == 1  # rowwise_with_gw_hp: one process's numbers, whatever the split
    dims = load_spec({"topology": {"procs_per_node": 4, "cp": 2}}).dims
    assert batch_split(dims, 2) == "dp 2 x cp 2 x 2 micro-batches"
    assert batch_split(load_spec({}).dims, 1) == ""


def test_plan_counts_the_float8_gather_in_one_byte():
    from parallel.tools.comm import float8_gathered, planned_collectives

    cfg = {"vocab_size": 256, "num_local_experts": 8}
    shapes = [(256, 32), (32, 32), (64, 32), (8, 32), (32,), (24, 32), (256, 32)]
    bf16 = load_spec({"precision": "bf16", "topology": {"procs_per_node": 8}})
    fp8 = load_spec({**FP8, "float8": {"all_gather": True}, "topology": {"procs_per_node": 8}})
    assert float8_gathered(bf16, shapes, cfg) == 0.0
    assert float8_gathered(fp8, shapes, cfg) == 32 * 32 + 64 * 32  # no vocab, router or odd dims
    psi, f8 = 1e6, 6e5
    ag16 = planned_collectives(bf16, psi)["all_gather"]
    ag8 = planned_collectives(fp8, psi, float8=f8)["all_gather"]
    assert ag16 - ag8 == 2 * f8  # FULL_SHARD gathers a block twice a step: 1 byte, not 2
    no_gather = load_spec({**FP8, "topology": {"procs_per_node": 8}})
    assert float8_gathered(no_gather, shapes, cfg) == 0.0


def test_exports_refuse_fp8_and_mfu_uses_the_bf16_peak():
    from parallel.engine.observe.flops import peak_flops
    from parallel.interop.exporting import trainer_args

    with pytest.raises(SpecError, match="precision"):
        trainer_args(load_spec(FP8))
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp8") == peak_flops("NVIDIA H100 80GB HBM3", "bf16")


def test_bench_makes_a_cell_per_precision():
    from parallel.tools.bench.report import cells

    spec = load_spec({**FP8, "float8": {"all_gather": True}, "topology": {"procs_per_node": 2}})
    got = {c.label(2): c for c in cells(spec, ["fsdp2", "zero2"], None, [], ["bf16", "fp8"])}
    assert set(got) == {"fsdp2/full/bf16/w2", "fsdp2/full/fp8/w2", "zero2/bf16/w2",
                        "zero2/fp8/w2"}
    assert got["fsdp2/full/bf16/w2"].data["precision"] == "bf16"
    assert got["fsdp2/full/fp8/w2"].data["float8"]["all_gather"] is True
    assert got["zero2/fp8/w2"].data is None and "float8.all_gather" in got["zero2/fp8/w2"].why


def test_an_expert_given_no_rows_trains_as_a_linear():
    """torchao 0.14.1 raises in backward on an empty input (its scale is a maximum over no
    element): the engine runs unused experts on empty inputs (moe/experts.py)."""
    said = []
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    apply_float8(model, Float8(recipe="rowwise"), torch.device("cpu"), said.append)
    empty = model(torch.zeros(0, 32, requires_grad=True))
    (empty.sum() + model(torch.randn(4, 32)).sum()).backward()
    assert empty.shape == (0, 32) and model[0].weight.grad is not None
