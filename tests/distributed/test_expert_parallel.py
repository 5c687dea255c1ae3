"""topology.ep against one process on the global batch.

The token dispatch block by block (expert_parallel_worker.py, in the shared 2-rank launch): every
Hugging Face mixture-of-experts family it splits gives one process's outputs and gradients within
1e-6, and an expert no rank routed a token to keeps no gradient on its owner.

Through the engine (parity_worker.py): every variant whose spec with ep 2 validates (matrix.accepting:
FSDP2; FSDP1, DeepSpeed and XLA refuse it naming why, tests/unit/test_dims.py) trains tiny toy MoE
models (parallel/toy.py) on padded SFT rows for 5 steps against one process, saves after step 3, loads
its weights alone and evaluates, then resumes in fresh processes:
- make test, ep 2 on 2 ranks: Mixtral top-2 with its balancing loss (global, 0.1), save_pretrained
  read back by transformers, greedy generate equal to a plain model's; Qwen2-MoE with its shared
  expert under accumulation and clipping; Qwen3-MoE with 64 experts top-8 and its balancing loss
  (experts unused in a step), and again with fsdp.cpu_ram_efficient_loading (rank 0 builds the
  weights; each rank takes its experts); the checkpoint moved to ep 1 on FSDP2 (exact) and on
  ZeRO-3 (a flat optimizer: within docs/moe.md's bound) and theirs back to ep 2.
- make test, 4 ranks: dp 2 x ep 2 with the 64-expert model, accumulation and clipping; pp 2 x ep 2
  and tp 2 x ep 2 with the trackers' loads (`wide_cases`).
- make test-full, 4 ranks: pp 2 x ep 2 moved to ep 1, with Qwen2-MoE, accumulation and clipping;
  hybrid sharding (replicas of ep-split experts), ep 2 x cp 2, torch.compile (dp 2 x ep 2).

What a step pays (parallel/tools/bench/counting.py), against the loop torchtitan's EP is written as
by hand (benchmarks/native_ep.py, the descriptor's native loop at ep > 1): the same collectives op
for op (the all-to-alls through c10d here, functional there), no more host reads, and no read of its
own when the loop does not read the loss.
"""

import json

import matrix
import pytest
from harness import case as parity_case
from harness import accepted, check_parity, parity_jobs, parity_results, tier_results
from shared import job, read

from parallel.registry import get
from parallel.spec.io import load_spec
from parallel.tools.bench.report import NATIVE_DIR

pytestmark = pytest.mark.distributed
BUDGET_S = 60  # seconds in make test (tests/conftest.py): the dispatch and ep 2's cases ride shared
#                launches; dp 2 x ep 2 is a 4-rank launch
MOE_FLAT_BOUND = 5e-3  # docs/moe.md: a flat optimizer updates experts no rank used (1.2e-3 measured)
AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.1}
# with accumulation each micro-batch's balancing loss is its own (docs/moe.md): those cases leave it
# off, so that one process on the global batch is the reference
MIXTRAL, QWEN2, QWEN3 = {"toy": "mixtral", **AUX}, {"toy": "qwen2_moe"}, {"toy": "qwen3_moe", **AUX}
QWEN3_LM = {"toy": "qwen3_moe"}
# pipeline stages take no balancing loss (docs/pipeline.md): 4 layers, a block per stage and ep group
MIXTRAL_LM, MIXTRAL_LM_4 = {"toy": "mixtral"}, {"toy": "mixtral", "num_hidden_layers": 4}
# Mixtral's own tp plan splits its experts in styles polyshard does not take (docs/tp.md): under ep
# the attention is split over tp, each tp rank's experts are its ep group's
ATTENTION_TP = {f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"} | {
    "model.layers.*.self_attn.o_proj": "rowwise"}


def with_ep(c, ep=2, cp=1, shard_group_size=None, pp=1, tp=1, tp_plan=None, **extra):
    """A variant's spec (as matrix laid it out on this host) with expert parallelism."""
    spec = {**c.spec, **extra}
    spec["topology"] = {**c.spec["topology"], "ep": ep, **({"cp": cp} if cp > 1 else {}),
                        **({"pp": pp} if pp > 1 else {}), **({"tp": tp} if tp > 1 else {}),
                        **({"tp_plan": tp_plan} if tp_plan else {}),
                        **({"shard_group_size": shard_group_size} if shard_group_size else {})}
    return spec


VARIANTS = {c.name: c for c in matrix.accepting(with_ep, 2)}
GROUPS = {"+".join(c.name for c in g): g for g in matrix.by_launch(matrix.accepting(with_ep, 2))}
WIDE = {"+".join(c.name for c in g): g for g in matrix.by_launch(matrix.accepting(with_ep, 4))}


def ep1(c, name):
    """The variant `name` that launches as `c` does: where an ep 2 checkpoint resumes at ep 1."""
    return next((o for o in matrix.cases(world=c.nproc, micro_batch_size=2, every=True)
                 if o.name == name and o.launch == c.launch), None)


def case(name, spec, model, **extra):
    """A parity case on a toy MoE model; with the balancing loss on, the weights-only load is held
    to the run's own evaluation (evaluate reports the language-model loss alone, docs/moe.md)."""
    aux = {"eval_at_save": True} if model.get("output_router_logits") else {}
    return parity_case(name, spec, optimizer="adamw", padded=True, model=model, **aux, **extra)


def cases(c):
    out = [case("mixtral-top2-aux-padded", with_ep(c), MIXTRAL, pretrained=True, generate=True,
                tracked=2),
           case("qwen2moe-shared-accum-clip", with_ep(c, grad_accum_steps=2, grad_clip=0.5),
                QWEN2),
           case("qwen3moe-64x8-aux", with_ep(c), QWEN3),
           # rank 0 builds the weights, the others on the meta device: each takes its experts
           case("qwen3moe-rank0-loading", with_ep(c, fsdp={**c.spec.get("fsdp", {}),
                                                         "cpu_ram_efficient_loading": True}),
                QWEN3_LM, factory=True)]
    for name in ("fsdp2", "zero3"):
        other = ep1(c, name)
        if other is not None:
            out += [{**case(f"to-{name}-ep1", with_ep(c), MIXTRAL), "resume_spec": other.spec},
                    {**case(f"from-{name}-ep1", other.spec, MIXTRAL), "resume_spec": with_ep(c)}]
    return [{**one, "name": f"{c.name}-{one['name']}"} for one in out if accepted(one)]


def wide_cases(c, tier="quick"):
    """4 ranks. make test: dp 2 x ep 2; pp 2 x ep 2 (each pipeline rank's ep group splits its
    stage's blocks) and tp 2 x ep 2 (each tp rank's ep group), with their trackers' loads. make
    test-full: pp 2 x ep 2's checkpoint moved to pp 2 at ep 1, pp 2 x ep 2 with Qwen2-MoE's shared
    expert, accumulation and clipping, hybrid sharding, ep 2 x cp 2, torch.compile."""
    accum = with_ep(c, grad_accum_steps=2, grad_clip=0.5)
    pp_ep, tracked = with_ep(c, pp=2), {"tracked": 2, "pretrained": True}
    chosen = [("dp2-ep2-64x8-accum-clip", accum, QWEN3_LM, {}),
              ("pp2-ep2-mixtral-tracked", pp_ep, MIXTRAL_LM_4, tracked),
              ("tp2-ep2-mixtral-tracked", with_ep(c, tp=2, tp_plan=ATTENTION_TP), MIXTRAL_LM,
               tracked)]
    if tier == "full":
        chosen += [("pp2-ep2-to-pp2-ep1", pp_ep, MIXTRAL_LM_4,
                    {"resume_spec": with_ep(c, ep=1, pp=2)}),
                   ("pp2-ep2-qwen2-accum-clip", with_ep(c, pp=2, grad_accum_steps=2, grad_clip=0.5),
                    QWEN2, {}),
                   ("hybrid-ep2-mixtral", with_ep(c, shard="hybrid", shard_group_size=2), MIXTRAL,
                    {}),
                   ("ep2-cp2-mixtral", with_ep(c, cp=2), MIXTRAL, {}),
                   ("dp2-ep2-compiled", with_ep(c, compile={"enabled": True}), MIXTRAL_LM, {})]
    return [{**case(name, spec, model, **extra), "name": f"{c.name}-{name}"}
            for name, spec, model, extra in chosen if accepted({"spec": spec})]


def fsdp2():
    return next(c for c in matrix.cases(world=2) if c.name == "fsdp2")


def key(prefix, group_name):
    return f"{prefix}-{group_name.replace('+', '-')}"


COUNTED = {"backend": "fsdp", "micro_batch_size": 2, "grad_clip": 1.0,
           "topology": {"procs_per_node": 2, "ep": 2}}


def count_jobs(tmp):
    """polyshard's steps at ep 2 (hot_path_worker.py) and the native loop's (native_ep.py), on the
    toy Mixtral, each counted after a warm-up."""
    (tmp / "ep-count-cases.json").write_text(json.dumps({"ep2": COUNTED}))
    script, flags = get("fsdp").bench.native(load_spec(COUNTED))
    native = {"ep2": [script, "--model=toy:mixtral", "--steps=3", "--warmup=2", "--seq=16",
                      "--global-rows=4", "--clip=1.0", "--count", *flags,
                      f"--out={tmp / 'ep-native.json'}"]}
    (tmp / "ep-native-cases.json").write_text(json.dumps(native))
    env = fsdp2().env
    return [job("hot_path_worker", ["--cases", tmp / "ep-count-cases.json", "--rows", 4, "--model",
                                    "mixtral", "--out", tmp / "ep-count.json"], 2, env),
            job(str(NATIVE_DIR / "cases.py"), ["--cases", tmp / "ep-native-cases.json", "--out",
                                               tmp / "ep-native-all.json"], 2, env)]


def shared_jobs(tmp):
    jobs = [job("expert_parallel_worker", ["--out", tmp / "ep.json"], 2, fsdp2().env),
            *count_jobs(tmp)]
    for name, group in GROUPS.items():
        jobs += parity_jobs(tmp, [one for c in group for one in cases(c)], nproc=group[0].nproc,
                            env=group[0].env, key=key("ep-2", name))
    for name, group in WIDE.items():
        jobs += parity_jobs(tmp, [one for c in group for one in wide_cases(c)],
                            nproc=group[0].nproc, env=group[0].env, key=key("ep-4", name))
    return jobs


def test_the_registry_has_ep_variants():
    assert set(VARIANTS) == {"fsdp2"}, sorted(VARIANTS)


def test_each_family_dispatches_to_its_experts_as_one_process_computes(shared):
    tmp, run = shared[__name__]
    ranks = read(tmp / "ep.json", run, "expert_parallel_worker")
    worst = {}
    for rank, found in enumerate(ranks):
        for name, f in found.items():
            assert max(f["output"], f["input_grad"], f["expert_grads"], f["other_grads"]) <= 1e-6, \
                (rank, name, f)
            assert not any("has a grad" in u for u in f["unused"]), (rank, name, f["unused"])
            worst[name] = max(worst.get(name, 0.0), f["output"], f["expert_grads"], f["other_grads"])
    # routing leaves experts idle: the 64-expert top-8 block and DeepSeek's group-limited routing
    assert ranks[0]["deepseek-v3-grouped"]["unused"] or ranks[1]["deepseek-v3-grouped"]["unused"]
    print(f"ep 2, largest difference from one process per block: {worst}")


def check(results, chosen):
    assert sorted(results) == sorted(one["name"] for one in chosen)
    worst = {}
    for one in chosen:
        name, res = one["name"], results[one["name"]]
        # ZeRO-3 steps flat tensors: it updates experts no rank used (docs/moe.md's bound), as the
        # run that trains on it and the one that resumes on it do
        flat = "zero3" in name
        moved = "resume_spec" in one  # another layout sums in another order
        trained_flat = "from-zero3" in name
        worst[name] = check_parity(name, res, tol=MOE_FLAT_BOUND if trained_flat else 1e-5,
                                   norm_tol=MOE_FLAT_BOUND * 10 if trained_flat else 1e-4,
                                   resume_tol=MOE_FLAT_BOUND if flat else 1e-5 if moved else 0.0)
        train = res["train"]
        assert abs(train["consolidated_loss"] - train["loss"][3]) <= 1e-5, (name, train)
        if one.get("pretrained"):
            assert abs(train["pretrained_loss"] - train["loss"][3]) <= 1e-5, (name, train)
        if one.get("generate"):
            assert train["generated"] == train["plain_generated"], train
        if one.get("tracked"):
            check_loads(name, train["tracked"], one)
    return worst


def check_loads(name, tracked, one):
    """The trackers' expert loads at each logging step: every token of every rank, each to its
    top-k experts in each block, over the steps since the last log (padding tokens are routed too)."""
    import json as _json

    from parallel.toy import SIZES

    toy = {**_json.loads(SIZES.read_text())[one["model"]["toy"]], **one["model"]}
    topology = one["spec"]["topology"]  # a step's rows: micro-batch x data-parallel ranks
    per_step = one["spec"]["micro_batch_size"] * topology["procs_per_node"] // \
        (topology.get("pp", 1) * topology.get("tp", 1)) * 16
    for line in tracked:
        tokens = sum(v for k, v in line.items() if k.startswith("moe/tokens/expert_"))
        assert tokens == per_step * toy["num_experts_per_tok"] * toy["num_hidden_layers"] * \
            one["tracked"], (name, line)
        assert line["moe/imbalance"] >= 1.0 and "moe/model.layers.0.mlp/imbalance" \
            in line, (name, line)
    assert [line["step"] for line in tracked] == [2, 4], (name, tracked)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_ep2_matches_one_process_resumes_and_moves_to_ep1(shared, group):
    tmp, run = shared[__name__]
    results = parity_results(tmp, run, key=key("ep-2", group))
    chosen = [one for c in GROUPS[group] for one in cases(c)]
    print(f"ep 2 ({group}): max |loss - one process| per case: {check(results, chosen)}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tier", ["quick", pytest.param("full", marks=pytest.mark.full)])
@pytest.mark.parametrize("group", sorted(WIDE))
def test_dp2_x_ep2_matches_one_process(request, tmp_path, group, tier):
    chosen = [one for c in WIDE[group] for one in wide_cases(c, tier)]
    results = tier_results(request, tmp_path, __name__, key("ep-4", group), chosen, WIDE[group][0],
                           tier)
    print(f"ep 2 on 4 ranks ({group}): max |loss - one process| per case: "
          f"{check(results, chosen)}")


def one_spelling(counts: dict) -> dict:
    """c10d's all-to-all and the functional one (torchtitan's, and polyshard's row exchanges) are
    one collective: counted under one name."""
    out: dict = {}
    for key, n in counts.items():
        key = key.replace("all_to_all_single", "alltoall_base_")
        out[key] = out.get(key, 0) + n
    return out


def test_a_step_pays_what_torchtitans_ep_by_hand_pays(shared):
    tmp, run = shared[__name__]
    ours = read(tmp / "ep-count.json", run, "hot_path_worker")["ep2"]
    steps = read(tmp / "ep-native-all.json", run, str(NATIVE_DIR / "cases.py"))["ep2"]["counts"]
    assert all(s == steps[0] for s in steps), steps  # steady
    theirs = one_spelling(steps[0])
    for mode in ("read", "noread"):
        counted = one_spelling(ours[mode])
        reads = counted.pop("host_reads", 0)
        assert counted == {k: v for k, v in theirs.items() if k != "host_reads"}, (mode, ours, theirs)
        assert reads <= theirs["host_reads"], (mode, ours, theirs)
    # the loss rides with the experts' use, read before the update: a loop's read adds none
    assert ours["read"]["host_reads"] == ours["noread"]["host_reads"], ours
    print(f"ep 2 per step: polyshard {ours['read']}, by hand {steps[0]}")
