"""`polyshard plan` as a decision tool: peaks (SHARD_GRAD_OP holds the gathered model, FULL_SHARD
two units), host memory for offload, communication seconds that pick "fastest", --json, a table
that keeps every column in a log, suggestions naming only what is off."""

import json

import pytest

from parallel.cli.main import main
from parallel.spec.io import load_spec
from parallel.tools.plan import Links, Margin, activations, plan

GiB = 2 ** 30
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_8B))
    return str(path)


def rows_of(capsys, *argv):
    code = main(["plan", "configs/demo.yaml", "--set", "precision=bf16", "--set",
                 "micro_batch_size=1", *argv, "--json"])
    data = json.loads(capsys.readouterr().out)
    return code, data, {(r["backend"], r["shard"], r["offload"]): r for r in data["rows"]}


def test_peaks_hold_what_each_shard_level_gathers(capsys, config):
    code, data, rows = rows_of(capsys, "--model", config, "--world", "64", "--seq", "4096",
                               "--budget", "80")
    psi, unit = data["parameters"], data["largest_unit"]
    # the largest unit FSDP gathers is the embedding (128256 x 4096), not a block (218.1M)
    assert psi == pytest.approx(8.03e9, rel=1e-3) and unit == 128256 * 4096
    full, grad_op = rows[("fsdp", "full", "none")], rows[("fsdp", "grad_op", "none")]
    # between steps both hold the same shards; SHARD_GRAD_OP keeps every unit gathered (bf16)
    assert full["params"] == grad_op["params"]
    assert grad_op["gathered"] == psi * 2 and full["gathered"] == 2 * unit * 2
    assert grad_op["peak"] > full["peak"]
    # offload: nothing of the optimizer on the device, all of it on the host (8 ranks a node)
    off = rows[("deepspeed", "full", "optimizer")]
    assert off["optimizer"] == 0 and off["host_per_node"] == pytest.approx(
        8 * (4 + 8) * psi / 64, rel=1e-6)
    assert off["offload_s"] > 0 and full["offload_s"] == 0
    # "fastest": the least communication seconds among what fits, a number in every row
    best = [r for r in data["rows"] if r["best"]]
    assert code == 0 and len(best) == 1 and best[0]["fits"]
    assert best[0]["comm_s"] + best[0]["offload_s"] == min(
        r["comm_s"] + r["offload_s"] for r in data["rows"] if r["fits"])
    # FULL_SHARD's 3 Psi vs SHARD_GRAD_OP's 2 Psi over the same links
    # FULL_SHARD gathers twice, SHARD_GRAD_OP once, in the compute dtype (bf16), and each
    # reduce-scatters once in the reduce dtype (fp32): (2 x 2 + 4) / (2 + 4), not 3 / 2 (#42)
    assert full["comm_s"] == pytest.approx(8 / 6 * grad_op["comm_s"])


def test_comm_seconds_follow_the_links_and_the_margin_is_stated():
    spec = load_spec({"precision": "bf16", "topology": {"procs_per_node": 8}})
    shapes, cfg = [(1000, 1000)] * 8, None
    fast, _ = plan(spec, shapes, cfg, 8, 128, links=Links(intra=400.0))
    slow, _ = plan(spec, shapes, cfg, 8, 128, links=Links(intra=100.0))
    assert slow[0].comm_s == pytest.approx(4 * fast[0].comm_s)
    spread, _ = plan(spec, shapes, cfg, 16, 128, per_node=8)  # the group spans two nodes
    assert spread[0].comm_s > fast[0].comm_s
    rows, _ = plan(spec, shapes, cfg, 8, 128, margin=Margin(1.0, 0.0))
    assert rows[0].margin == GiB


def eager_minus_sdpa(cfg, seq: int, tokens: int) -> float:
    """What eager attention keeps beyond SDPA per the activation model, in bf16: per layer and token,
    k and v repeated to every head and one contiguous copy fewer (4h against 3h + 2h x kv / a, 2
    bytes each) and 6 bytes per score (the fp32 softmax and its bf16 cast); in flight at the peak,
    the larger of the loss's backward (8 bytes per logit) and one layer's: two fp32 score-sized
    gradients against the MLP's three bf16 ones."""
    h, a, kv, layers, inner, vocab = (cfg[k] for k in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
        "intermediate_size", "vocab_size"))
    per_layer = 2 * 4 * h - 2 * (3 * h + 2 * h * kv / a) + 6 * a * seq
    loss = 8 * tokens * vocab
    return (tokens * layers * per_layer + max(loss, tokens * 8 * a * seq)
            - max(loss, tokens * 3 * 2 * inner))


def test_activations_count_scores_only_for_eager_attention():
    cfg = {**LLAMA_8B}
    sdpa = activations(cfg, 1, 4096, "bf16", False)
    eager = activations({**cfg, "_attn_implementation": "eager"}, 1, 4096, "bf16", False)
    assert eager - sdpa == pytest.approx(eager_minus_sdpa(cfg, 4096, 4096))
    ckpt = activations(cfg, 1, 4096, "bf16", True)
    loss = 12 * 4096 * cfg["vocab_size"]  # log-probabilities and their backward, either way
    assert ckpt - loss < (sdpa - loss) / 4  # inputs kept, one layer recomputed at a time
    # the scores grow with the square of the row: 4x at twice the length, the rest 2x
    longer = activations({**cfg, "_attn_implementation": "eager"}, 1, 8192, "bf16", False)
    assert 3.5 < (longer - activations(cfg, 1, 8192, "bf16", False)) / (eager - sdpa) < 4.5


def test_a_tiled_loss_and_offloaded_activations_are_counted():
    cfg = {**LLAMA_8B}
    whole = activations(cfg, 1, 32768, "bf16", True)
    tiled = activations(cfg, 1, 32768, "bf16", True, loss_tile=1024)
    # fp32 log-probabilities kept (4 bytes a logit) for 1024 tokens, not 32768; in flight, the
    # whole loss's backward (8 bytes a logit) against the larger of one tile's and one layer's
    vocab, layer = cfg["vocab_size"], 3 * 2 * cfg["intermediate_size"]
    assert whole - tiled == 4 * (32768 - 1024) * vocab + 8 * 32768 * vocab - max(
        8 * 1024 * vocab, 32768 * layer)
    offloaded = activations(cfg, 1, 32768, "bf16", True, loss_tile=1024, offload=True)
    inputs = 2 * 32768 * cfg["hidden_size"] * cfg["num_hidden_layers"]  # each layer's, on the host
    assert tiled - offloaded == inputs


def test_cp_divides_each_ranks_tokens_and_the_longest_row_grows_with_it():
    cfg = {**LLAMA_8B}
    one = activations(cfg, 1, 131072, "bf16", True, loss_tile=1024)
    four = activations(cfg, 1, 131072, "bf16", True, loss_tile=1024, cp=4)
    tile = 4 * 1024 * cfg["vocab_size"]  # one tile's log-probabilities, whatever the split
    # every per-token term (one layer's backward outweighs one tile's at both splits)
    assert four - tile == pytest.approx((one - tile) / 4)
    # eager's scores: whole rows, a / (tp x cp) heads per rank
    eager = {**cfg, "_attn_implementation": "eager"}
    scores = activations(eager, 1, 8192, "bf16", False, cp=4) - activations(cfg, 1, 8192, "bf16",
                                                                            False, cp=4)
    assert scores == pytest.approx(eager_minus_sdpa(cfg, 8192, 8192 // 4))
    from parallel.tools.plan import longest_seq

    spec = load_spec("configs/tp8-cp4-llama3-8b.yaml")
    flat = load_spec({**spec.model_dump(mode="json", exclude_unset=True),
                      "topology": {"nodes": 32, "procs_per_node": 8, "tp": 8}})
    shapes = [(int(8.03e9 / 8),)]
    cp4, cp1 = (longest_seq(s, shapes, cfg, 80 * 2**30) for s in (spec, flat))
    assert cp4 % 4 == 0 and 3.5 < cp4 / cp1 < 4.5, (cp4, cp1)
    assert longest_seq(spec, shapes, cfg, 1.0) == 0  # nothing fits a byte


def test_cp_comm_bytes_count_ulysses_exchanges():
    from parallel.tools.comm import cp_comm_bytes

    spec = load_spec("configs/tp8-cp4-llama3-8b.yaml")
    # 32 layers x 3 passes (forward, backward, recomputation) x (q + out + k + v): 4 query heads and
    # 1 key/value head repeated 4 times per rank, 128 dims, 8192 / 4 tokens, bf16
    assert cp_comm_bytes(LLAMA_8B, spec, 8192) == 32 * 3 * 4 * (2048 * 4 * 128 * 2)
    assert cp_comm_bytes(LLAMA_8B, load_spec("configs/tp8-llama3-8b.yaml"), 8192) == 0


def test_the_table_keeps_every_column_in_a_log_and_suggests_only_what_is_off(capsys, config):
    code = main(["plan", "configs/demo.yaml", "--set", "activation_checkpointing=true",
                 "--model", config, "--world", "8", "--budget", "10"])
    out = capsys.readouterr().out
    assert code == 1 and "host GiB/node" in out and "comm ms/step" in out and "…" not in out
    assert "nothing fits in 10.0 GiB" in out and "more devices" in out
    assert "activation_checkpointing" not in out.split("nothing fits")[1]  # already on


def test_bench_and_plan_take_the_users_own_model_factory(tmp_path, monkeypatch):
    """--model module:factory (a LoRA model here), imported from the working directory."""
    from parallel.toy import build_model

    (tmp_path / "my_job.py").write_text(
        "from peft import LoraConfig, get_peft_model\n"
        "from parallel.toy import build_llama, llama_config\n"
        "def model():\n"
        "    return get_peft_model(build_llama(llama_config('tiny')), LoraConfig(\n"
        "        r=4, target_modules=['q_proj', 'v_proj']))\n")
    monkeypatch.chdir(tmp_path)
    model = build_model("my_job:model")
    assert type(model).__name__.startswith("PeftModel")
    assert 0 < sum(p.numel() for p in model.parameters() if p.requires_grad) < 10_000
    with pytest.raises(ValueError, match="my_job:nothing"):
        build_model("my_job:nothing")


def test_plan_splits_by_tp(capsys, config):
    """tp 8: one rank's shapes after the model's own plan (q/k/v/o/gate/up/down and the head split
    8 ways, embeddings and norms whole), sharded again over 1024 / 8 data-parallel ranks; only
    the backends that can split are rows; TP's all-reduces add communication."""
    code, data, rows = rows_of(capsys, "--model", config, "--world", "1024", "--seq", "16",
                               "--set", "topology.procs_per_node=8", "--set", "topology.tp=8")
    layer = 4096 * (4096 + 1024 + 1024 + 4096 + 3 * 14336) // 8 + 2 * 4096
    whole = 128256 * 4096 + 4096  # embedding, final norm
    assert data["tp"] == 8 and data["parameters"] == 32 * layer + whole + 128256 * 4096 // 8
    # FSDP2 and DeepSpeed (AutoTP, every ZeRO stage) split; XLA v1 cannot
    assert {k[0] for k in rows} == {"fsdp", "deepspeed"}
    assert {k[1] for k in rows if k[0] == "deepspeed"} >= {"none", "optimizer", "grad_op", "full"}
    code1, data1, rows1 = rows_of(capsys, "--model", config, "--world", "1024", "--seq", "16")
    assert rows[("fsdp", "full", "none")]["comm_s"] > 0
    assert rows[("fsdp", "full", "none")]["activations"] < rows1[("fsdp", "full", "none")][
        "activations"]


def test_a_tied_model_counts_its_shared_weight_once(capsys, tmp_path):
    """lm_head.weight is embed_tokens.weight: one parameter in the units, not a KeyError (plan
    crashed on every tied config, configs/models/llama-125m.json included)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA_8B, "tie_word_embeddings": True}))
    code, data, _ = rows_of(capsys, "--model", str(path), "--world", "8")
    assert code == 0 and data["largest_unit"] == 128256 * 4096
    assert data["parameters"] == pytest.approx(8.03e9 - 128256 * 4096, rel=1e-3)


def test_world_applies_before_the_layout_is_checked_and_heads_are_checked_with_model(
        capsys, config):
    """`--world 1024 --set topology.cp=4` on an 8-rank tp 8 file: the layout is checked against
    the world asked about (it was refused against the file's 8, naming tp); a cp that does not
    divide the heads fails at once with --model, not 70 lines into a launch; a cp that does not
    divide the world names cp."""
    code, data, _ = rows_of(capsys, "--model", config, "--world", "1024", "--set", "topology.cp=4",
                            "--set", "topology.tp=8")
    assert code == 0 and data["cp"] == 4 and data["tp"] == 8
    assert main(["plan", "configs/demo.yaml", "--model", config, "--world", "6", "--set",
                 "topology.cp=3"]) == 2
    assert "topology.cp: 3: LlamaForCausalLM: num_attention_heads 32" in capsys.readouterr().err
    assert main(["explain", "configs/demo.yaml", "--model", config, "--set", "topology.cp=3",
                 "--set", "topology.procs_per_node=3"]) == 2
    assert "which cp 3 does not divide" in capsys.readouterr().err
    assert main(["validate", "configs/demo.yaml", "--set", "topology.cp=3"]) == 2
    assert "topology.cp: 3 does not divide the world size 2" in capsys.readouterr().err


def test_ep_over_transformers_5s_fused_experts_is_refused_as_the_engine_refuses_it(capsys, tmp_path):
    """configs/ep8-qwen3-30b-a3b.yaml: transformers 5 builds Qwen3-MoE's experts fused in 3-D tensors,
    which topology.ep does not split yet (it splits experts held as a ModuleList: an MoE of one's
    own): plan refuses it as prepare does, naming the field and the fix (docs/moe.md)."""
    config = json.loads(open("configs/models/qwen3-30b-a3b.json").read())
    (tmp_path / "m.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    code = main(["plan", "configs/ep8-qwen3-30b-a3b.yaml", "--model", str(tmp_path / "m.json"),
                 "--world", "1024", "--seq", "4096", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and "topology.ep" in err and "fused in 3-D tensors" in err, err
    assert "topology.ep: 1" in err and "Traceback" not in err

def test_plan_starts_from_the_spec_as_written(capsys, config):
    """#80: the spec's own backend, shard and offload are the first row, marked, beside every
    other candidate."""
    code, data, rows = rows_of(capsys, "--model", config, "--world", "64", "--set",
                               "backend=deepspeed", "--set", "shard=grad_op")
    assert [k for k, r in rows.items() if r["spec"]] == [("deepspeed", "grad_op", "none")]
    assert main(["plan", "configs/demo.yaml", "--set", "backend=deepspeed", "--model", config,
                 "--world", "64"]) == 0
    table = capsys.readouterr().out
    first = next(line for line in table.splitlines() if "deepspeed" in line or "fsdp" in line)
    assert "deepspeed" in first and "full" in first and "this spec" in first, table


def test_plans_checkpoint_bytes_are_a_real_checkpoints(tmp_path):
    """#80: plan's checkpoint bytes per rank (fp32 weights + AdamW's two moments) against the bytes
    a real save of the tiny Llama wrote (one rank; sharded saves divide it by N: docs/checkpoint-
    format.md measures the fall with N)."""
    import torch

    from parallel import create_engine, load_spec
    from parallel.tools.plan import checkpoint_bytes
    from parallel.toy import build_llama, llama_config

    spec = load_spec({"micro_batch_size": 2})
    engine = create_engine(spec)
    torch.manual_seed(0)
    tiny = llama_config("tiny")
    engine.prepare(build_llama(tiny), (torch.optim.AdamW, {"lr": 1e-2}))
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    engine.train_step({"input_ids": ids, "labels": ids})  # the moments exist
    engine.save(tmp_path / "ckpt")
    engine.close()
    written = sum(f.stat().st_size for f in (tmp_path / "ckpt" / "state").glob("*.distcp"))
    shapes = [tuple(p.shape) for p in build_llama(tiny).parameters()]
    planned = checkpoint_bytes(spec, shapes, {"vocab_size": 256})
    # beyond the payload, DCP's torch.save framing of each stored tensor (the weight, AdamW's two
    # moments and its step): measured 1,577 B a tensor, 554,529 B written for 419,712 planned over
    # 4 x 21 tensors; a real model's megabyte tensors dwarf it
    assert planned <= written <= planned + 2048 * 4 * len(shapes), (planned, written)


def test_a_sweep_is_one_table_of_the_spec_at_each_value(capsys, config):
    """#80: `plan --sweep tp=1,2,8,3`: the spec as written at each degree, one row each; the
    checkpoint a rank writes is the whole model's share whatever the split; a degree the spec's
    rules refuse says why."""
    assert main(["plan", "configs/demo.yaml", "--set", "precision=bf16", "--model", config,
                 "--world", "64", "--sweep", "tp=1,2,8,3"]) == 0
    rows = [[c.strip() for c in line.split("│")[1:-1]]
            for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert [r[0] for r in rows] == ["1", "2", "8", "3"], rows
    assert len({r[6] for r in rows[:3]}) == 1 and float(rows[0][6]) == pytest.approx(
        8.03e9 * 12 / 64 / 2 ** 30, rel=1e-2)  # fp32 weights + AdamW's moments, 1/64 each
    assert float(rows[0][5]) > float(rows[2][5])  # tp 8 moves less over FSDP's shard group
    assert rows[3][1].startswith("refused: 3 does not divide the world size 64")
    assert main(["plan", "configs/demo.yaml", "--model", config, "--world", "8",
                 "--sweep", "dp=1,2"]) == 2
