"""topology.pp's spec rules and stage split, in one process: what each backend refuses and why, each
schedule's rules, and every Hugging Face decoder family split into stages whose chained forwards
give the whole model's logits, under the model's own parameter names (the distributed exactness:
tests/distributed/test_pipeline.py)."""

import pytest
import torch

from parallel import load_spec
from parallel.engine.model.pipeline import stages as st
from parallel.engine.model.pipeline.apply import check_pipelined, merged_view
from parallel.engine.model.pipeline.schedule import stage_ids
from parallel.kits.objective import Objective, count_shifted
from parallel.spec.errors import SpecError


def problems(spec: dict) -> dict:
    with pytest.raises(SpecError) as err:
        load_spec(spec)
    return dict(err.value.problems)


def pp(schedule="1f1b", world=2, degree=2, mbs=4, **extra):
    return {"topology": {"procs_per_node": world, "pp": degree}, "micro_batch_size": mbs,
            "pipeline": {"schedule": schedule, **extra}}


def test_xla_refuses_pp_naming_the_field_and_the_doc():
    message = problems({**pp(), "backend": "xla_fsdp"})["topology.pp"]
    assert "backend 'xla_fsdp' does not implement pipeline" in message
    assert "docs/pipeline.md" in message


def ds(shard="none", **extra):
    return {**pp(), "backend": "deepspeed", "shard": shard, **extra}


def test_deepspeed_runs_pp_at_zero0_in_fp32_and_refuses_the_rest_naming_why():
    from backends.deepspeed.config.translate import translate

    config = translate(load_spec({**ds(grad_accum_steps=3, grad_clip=0.5),
                                  "pipeline": {"microbatches": 2}}))["config"]
    # a DeepSpeed micro-batch is a pipeline micro-batch; one schedule a step; clipping is ours
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"], config["gradient_clipping"]) == (2, 6, 12, 0.0)
    for shard in ("grad_op", "full"):
        assert "incompatible with pipeline" in problems(ds(shard))["shard"]
    zero1 = problems(ds("optimizer"))["shard"]  # exact on torch 2.15; checkpoints not built
    assert "4.8e-7" in zero1 and "7.3e-4 off on torch 2.9" in zero1 and "layer index" in zero1
    assert "FSDP2" in problems(ds("full"))["shard"]
    assert "1F1B" in problems({**ds(), "pipeline": {"schedule": "gpipe"}})["pipeline.schedule"]
    assert "data parallelism only" in problems(
        {**ds(), "topology": {"procs_per_node": 4, "pp": 2, "tp": 2}})["topology.tp"]
    assert "fp32 only" in problems(ds(precision="bf16"))["precision"]
    assert "compile" in problems(ds(compile={"enabled": True}))["compile.enabled"]


def test_fsdp1_and_rank0_loading_are_refused_with_pp():
    assert "fsdp.version: 2" in problems({**pp(), "fsdp": {"version": 1}})["topology.pp"]
    lazy = problems({**pp(), "fsdp": {"cpu_ram_efficient_loading": True}})
    assert "rank 0 holds the first stage only" in lazy["fsdp.cpu_ram_efficient_loading"]


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_shaped_schedules_are_refused_on_fsdp2_with_the_measured_difference(schedule):
    message = problems(pp(schedule))["pipeline.schedule"]
    assert "wrong gradients" in message and "interleaved_1f1b" in message
    assert "pipeline_v_worker.py" in message


def test_each_schedule_is_held_to_what_torch_runs():
    assert load_spec(pp("gpipe")).pipeline.stages_per_rank == 1
    assert load_spec(pp("interleaved_1f1b")).pipeline.stages_per_rank == 2
    assert "pipeline.virtual_stages" in problems(pp("1f1b", virtual_stages=2))
    assert "pipeline.virtual_stages" in problems(pp("interleaved_1f1b", virtual_stages=1))
    assert "divide" in problems(pp(microbatches=3))["pipeline.microbatches"]
    # 1f1b needs a micro-batch per stage in flight
    assert "at least 2" in problems(pp(mbs=1))["pipeline.microbatches"]
    # interleaved: a multiple of its rounds (n // pp)
    assert "rounds" in problems(pp("interleaved_1f1b", mbs=5))["pipeline.microbatches"]
    assert load_spec(pp(microbatches=2)).pipeline.microbatches == 2
    # the last stage weighs micro-batches by their targets: the mean of means is refused
    assert "tokens" in problems({**pp(), "loss_weighting": "micro_batches"})["loss_weighting"]


def test_the_pipeline_section_at_pp1_is_refused_unless_it_is_the_default():
    assert "nothing is pipelined" in problems({"pipeline": {"schedule": "gpipe"}})["pipeline"]
    assert load_spec({"pipeline": {"schedule": "1f1b"}}).pipeline.schedule == "1f1b"


def test_stages_are_assigned_as_torch_maps_them():
    assert [stage_ids("1f1b", r, 4, 1) for r in range(4)] == [[0], [1], [2], [3]]
    assert stage_ids("interleaved_1f1b", 1, 4, 2) == [1, 5]
    assert [stage_ids("zbv", r, 2, 2) for r in range(2)] == [[0, 3], [1, 2]]


def test_layers_split_evenly_or_where_split_points_say():
    assert st.layer_bounds(5, 2, None, "model.layers") == [(0, 3), (3, 5)]
    assert st.layer_bounds(4, 2, ["model.layers.1"], "model.layers") == [(0, 1), (1, 4)]
    with pytest.raises(SpecError) as err:
        st.layer_bounds(4, 2, ["model.layers.7"], "model.layers")
    assert "pipeline.split_points" in dict(err.value.problems)
    with pytest.raises(SpecError):
        st.layer_bounds(1, 2, None, "model.layers")  # a stage without a layer


def families():
    """A tiny model of each family polyshard splits, untied, eager attention."""
    import transformers as tf

    common = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
              "attn_implementation": "eager"}
    moe = {"num_local_experts": 4, "num_experts_per_tok": 2}
    return {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**common)),
        "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**common, **moe)),
        "qwen2_moe": lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16)),
        "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8)),
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=64,
            attn_implementation="eager", tie_word_embeddings=False)),
    }


@pytest.mark.parametrize("family", sorted(families()))
def test_every_family_splits_into_stages_that_chain_to_the_whole_model(family):
    """Four stages of each family, run one after another on padded rows: the whole model's logits
    (within 1e-5), and every parameter exactly once under its own name."""
    torch.manual_seed(0)
    whole = families()[family]().eval()
    names = {n for n, _ in whole.named_parameters()}
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    expected = whole(input_ids=ids, attention_mask=mask, use_cache=False).logits
    parts = st.split(whole, [0, 1, 2, 3], 4, None, {"use_cache": False})
    x = ids
    for part in parts:
        x = part(x, attention_mask=mask)
    assert torch.allclose(x, expected, atol=1e-5), (x - expected).abs().max()
    held = [n for part in parts for n, _ in part.named_parameters()]
    assert sorted(held) == sorted(names)
    view = merged_view(parts[:2], st.family_of(whole))  # one rank holding two stages
    assert {n for n, _ in view.named_parameters()} == {n for p in parts[:2]
                                                       for n, _ in p.named_parameters()}


def test_what_a_pipeline_cannot_run_exactly_is_refused_at_prepare():
    from parallel.toy import build_llama, llama_config

    tied = build_llama(llama_config("tiny", tie_word_embeddings=True))
    from parallel.engine.model.params import tied_groups

    counted = Objective(count_shifted, 1)
    with pytest.raises(SpecError) as err:
        check_pipelined(tied, tied_groups(tied), counted, False, None)
    assert "tie_word_embeddings=False" in dict(err.value.problems)["topology.pp"]
    untied = build_llama(llama_config("tiny"))
    with pytest.raises(SpecError, match="loss_fn"):
        check_pipelined(untied, [], counted, True, None)
    with pytest.raises(SpecError, match="causal LM's labels loss"):
        check_pipelined(untied, [], Objective(None, 1), False, None)
    with pytest.raises(SpecError) as err:
        check_pipelined(torch.nn.Linear(2, 2), [], Objective(None, 1), False, None)
    assert "has no stage split" in dict(err.value.problems)["pipeline.split_points"]
    # a mixture-of-experts model sharded over data-parallel ranks under a multi-stage schedule
    # (measured: a collective mismatch, docs/moe.md)
    with pytest.raises(SpecError) as err:
        check_pipelined(untied, [], counted, False, None, experts_shared="interleaved_1f1b")
    assert "use 1f1b or gpipe" in dict(err.value.problems)["pipeline.schedule"]


def test_a_model_of_your_own_splits_where_split_points_say_and_chains_to_the_whole():
    """torchtitan's contract: what precedes the named layers runs first, what follows last, an
    identity elsewhere; the causal-LM loss is taken on its logits, counted, and said."""
    from parallel.toy import OwnDecoder

    torch.manual_seed(0)
    whole = OwnDecoder(layers=4).eval()
    ids, mask = torch.randint(0, 256, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    expected = whole(ids, attention_mask=mask)
    names = {n for n, _ in whole.named_parameters()}
    assert st.own_family(whole, ["layers.2"]) == st.Family(
        "layers", ("tok_embeddings",), ("norm", "output"), own=True)
    parts = st.split(whole, [0, 1, 2], 3, ["layers.1", "layers.3"], {})
    x = ids
    for part in parts:
        x = part(x, attention_mask=mask)
    assert torch.equal(x, expected)
    assert sorted(n for part in parts for n, _ in part.named_parameters()) == sorted(names)
    assert [list(p.layers._modules) for p in parts] == [["0"], ["1", "2"], ["3"]]
    said, objective = [], Objective(None, 1)
    check_pipelined(OwnDecoder(), [], objective, False, None, ["layers.1"], said.append)
    assert objective.count is count_shifted and "causal-LM loss" in said[0]
    for bad in (["norm.1"], ["layers.1", "blocks.2"], ["layers.0"], ["layers.9"]):
        with pytest.raises(SpecError) as err:
            st.split(OwnDecoder(layers=4), [0, 1], 2 if len(bad) == 1 else 3, bad, {})
        assert "pipeline.split_points" in dict(err.value.problems), bad


def test_plan_counts_each_schedules_bubble_and_what_a_stage_holds_and_sends(capsys, tmp_path):
    import json

    from parallel.cli.main import main
    from parallel.tools.stages import bubble, in_flight

    # (p - 1) / (m + p - 1); interleaving divides the micro-batches' share by v
    assert bubble("1f1b", 4, 1, 8) == pytest.approx(3 / 11) == bubble("gpipe", 4, 1, 8)
    assert bubble("interleaved_1f1b", 4, 2, 8) == pytest.approx(3 / 19)
    # gpipe holds every micro-batch at the turn, 1f1b at most p, interleaved its warm-up
    assert (in_flight("gpipe", 4, 1, 8), in_flight("1f1b", 4, 1, 8),
            in_flight("interleaved_1f1b", 4, 2, 8)) == (8, 4, 11)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}))
    code = main(["plan", "configs/demo.yaml", "--model", str(config), "--world", "1024", "--seq",
                 "4096", "--set", "precision=bf16", "--set", "topology.procs_per_node=8", "--set",
                 "topology.tp=8", "--set", "topology.pp=8", "--set", "micro_batch_size=8",
                 "--json"])
    facts = json.loads(capsys.readouterr().out)["pipeline"]
    assert code == 0 and facts["stages"] == 8 and facts["bubble"] == pytest.approx(7 / 15)
    # each of a middle rank's 8 micro-batches: 1 row x 4096 tokens x 8192 hidden x bf16, each way
    assert facts["p2p_bytes"] == 2 * 8 * 4096 * 8192 * 2
    assert 0 < facts["activations"] and facts["stage_params"] < 70e9 / 8 / 4


@pytest.mark.parametrize("fmt", ["accelerate", "hf-trainer", "deepspeed"])
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_a_pipelined_spec_is_not_exported_to_files_that_carry_no_stages(fmt, backend):
    from parallel.interop.export import export

    with pytest.raises(SpecError) as err:
        export(load_spec({**pp(), "backend": backend, "shard": "none"}), fmt)
    assert "no pipeline stages" in dict(err.value.problems)["topology.pp"]


def test_a_section_an_override_makes_irrelevant_is_dropped_saying_so(capsys):
    """#80: moving a pp 2 job to pp 1 took `pipeline.microbatches=null` too, and an fp8 job to bf16
    a float8 section removed by hand. The one --set now says it; a file written with both is still
    refused (it says what its author wrote)."""
    base = {"topology": {"procs_per_node": 4, "pp": 2}, "micro_batch_size": 4,
            "pipeline": {"microbatches": 4, "schedule": "interleaved_1f1b"}}
    spec = load_spec(base, ["topology.pp=1", "backend=deepspeed"])
    assert spec.topology.pp == 1 and "pipeline" not in spec.model_fields_set
    fp8 = {"precision": "fp8", "float8": {"recipe": "rowwise"}}
    assert load_spec(fp8, ["precision=bf16"]).precision == "bf16"
    err = capsys.readouterr().err
    assert "polyshard: pipeline: dropped, since --set topology.pp=1 leaves it unread" in err
    assert "polyshard: float8: dropped, since --set precision=bf16" in err
    with pytest.raises(SpecError, match="float8: is read only with precision: fp8"):
        load_spec({"precision": "bf16", "float8": {"recipe": "rowwise"}})
    with pytest.raises(SpecError, match="pipeline: .* set, but topology.pp is 1"):
        load_spec(base, ["topology.pp=1", "pipeline.schedule=gpipe"])  # named again: kept
