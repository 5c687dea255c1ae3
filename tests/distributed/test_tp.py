"""Tensor parallelism (`topology.tp`) through the engine, against one process on the global batch.

Cases come from the registry: every variant (matrix.cases: fsdp2, fsdp1, zero0-3, xla1, xla2, ...)
whose spec with tp 2 validates (FSDP2, ZeRO-0/1/2/3 through AutoTP, XLA SPMD) runs dp 2 x tp 2 on 4
ranks or devices, with padded SFT rows, accumulation, clipping and activation checkpointing, and a
head tied to its embedding (and what only FSDP2 has: HSDP's 3-D mesh, rank-0-only loading and
per-block compile; XLA compiles every step anyway), saving after step 3 and resuming in fresh
processes; then a tp 2 checkpoint moves to tp 1, to another world size and to the other backends."""

import json

import matrix
import pytest
from harness import (ROOT, case, check_parity, needs_both, parity_jobs, parity_results,
                     run_parity, torchrun)
from shared import job, read


pytestmark = pytest.mark.distributed
BUDGET_S = 30  # seconds in make test (tests/conftest.py)


def with_tp(c, tp=2, **extra):
    """A variant's spec (as matrix laid it out on this host) with tensor parallelism."""
    spec = {**c.spec, "wrap": {"policy": "auto"}, **extra}
    spec["topology"] = {**c.spec["topology"], "tp": tp}
    return spec


def tp_variants(world=4):
    # the backends that refuse tp in this mode (FSDP1, ZeRO, XLA v1): unit-tested
    return matrix.accepting(with_tp, world)


VARIANTS = {c.name: c for c in tp_variants()}
# variants that launch alike share one launch pair (train, resume): FSDP2 and ZeRO-0-3 at 4 ranks
GROUPS = {"+".join(c.name for c in group): group for group in matrix.by_launch(tp_variants())}
# make test: the same groups' quick() variants at tp 2 on 2 ranks (dp 1: four processes on a 2-core
# host cost twice the time); dp 2 x tp 2 is make test's in the transfer loads below and make
# test-full's here
QUICK = {"+".join(c.name for c in group): matrix.quick(group)
         for group in matrix.by_launch(tp_variants(world=2))}


def cases(c, tier="full"):
    """A variant's TP cases. make test ("quick", dp 1) runs one case per variant holding every
    option at once (a tied head, padded rows, accumulation, clipping, checkpointing, AdamW) and what
    only one backend has; make test-full ("full", dp 2) runs each option on its own too, HSDP and
    compile."""
    base = with_tp(c)
    everything = {**base, "micro_batch_size": 1, "grad_accum_steps": 2, "grad_clip": 0.5,
                  "activation_checkpointing": True}
    if tier == "quick":
        # the head tied to the embedding stays whole (the model's plan would split it)
        out = [case("tied-padded-accum-clip-ac", everything, optimizer="adamw", padded=True,
                    model={"tie_word_embeddings": True})]
    else:
        out = [case("dp2-tp2", base, optimizer="adamw"),
               case("tied-head", base, model={"tie_word_embeddings": True}),
               case("padded-accum-clip-ac", everything, optimizer="adamw", padded=True)]
    if c.name == "zero3":  # built partitioned under zero.Init, then split by AutoTP
        out.append(case("zero-init", base, optimizer="adamw", factory=True))
    if c.name == "fsdp2":  # what only FSDP2 has
        out.append(case("rank0-loading", {**base, "fsdp": {"version": 2,
                                                           "cpu_ram_efficient_loading": True}},
                        optimizer="adamw", factory=True))
        if tier == "full":  # at dp 2 (make test's quick tier runs dp 1: no replicas to make)
            out += [case("hsdp-3d", {**base, "shard": "hybrid", "topology": {
                        **base["topology"], "shard_group_size": 1}}),
                    # torchtitan's order: TP, then compile per block, then fully_shard
                    case("compile-blocks", {**base, "compile": {"enabled": True,
                                                                "scope": "blocks"}},
                         optimizer="adamw")]
    return [{**one, "name": f"{c.name}-{one['name']}"} for one in out]


def test_the_registry_has_tp_variants():
    assert {"fsdp2", "xla2", "zero0", "zero1", "zero2", "zero3"} <= set(VARIANTS), sorted(VARIANTS)


def shared_jobs(tmp):
    """make test's tier in the suite's shared launches (shared.py): each group's parity cases, and
    the checkpoint transfers' saves (phase 1) and loads (phase 2)."""
    jobs = []
    for group, variants in sorted(QUICK.items()):
        key = "tp-" + group.replace("+", "-")
        jobs += parity_jobs(tmp, [one for c in variants for one in cases(c, "quick")],
                            nproc=variants[0].nproc, env=variants[0].env, key=key)
    jobs.append(job("lora_tp_worker", ["--out", tmp / "lora.json"], 2))
    transfers = tmp / "transfers"
    transfers.mkdir()
    for phase, names, c in transfer_launches(transfers, "quick"):
        jobs.append(job("transfer_worker", transfer_args(transfers, phase, names), c.nproc, c.env,
                        1 if phase == "save" else 2))
    return jobs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tier", ["quick", pytest.param("full", marks=pytest.mark.full)])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_tp_matches_one_process_and_resumes(request, tmp_path, group, tier):
    variants = GROUPS[group] if tier == "full" else QUICK[group]
    if tier == "quick":
        tmp, run = request.getfixturevalue("shared")[__name__]
        results = parity_results(tmp, run, key="tp-" + group.replace("+", "-"))
    else:  # make test-full: every option on its own, launches of its own
        results = run_parity(tmp_path, [one for c in variants for one in cases(c, tier)],
                             nproc=variants[0].nproc, timeout=500, env=variants[0].env)
    # XLA SPMD at tp 2 resumed from padded rows with accumulation: the first resumed step is
    # identical, the second 4.8e-7 off (measured; docs/tp.md; the cause is not pinned down: lost
    # or stale state shows at 1e-3, as the transfer test below would)
    spmd = variants[0].spec.get("xla", {}).get("fsdp_version") == 2
    worst = {name: check_parity(name, res, resume_tol=1e-6 if spmd else 0.0)
             for name, res in results.items()}
    tied = "tied-padded-accum-clip-ac" if tier == "quick" else "tied-head"
    for c in variants:
        notices = " ".join(results[f"{c.name}-{tied}"]["train"].get("notices", []))
        assert "lm_head.weight stays whole" in notices, (c.name, notices)
    for name, res in results.items():  # the checkpoint read whole in one process: full shapes
        assert abs(res["train"]["consolidated_loss"] - res["train"]["loss"][3]) <= 1e-5, name
        stats = res["train"].get("compile")
        if stats is not None:  # every block ran compiled over DTensors, nothing compiled late
            assert stats["ran_compiled"] == stats["units"] > 0 and stats["late_graphs"] == 0, stats
        if "matrix_specs" in res["train"]:  # SPMD: weights tiled over both mesh axes (2 x 2;
            # make test's dp 1: split over tp alone)
            tiled = "devices=[2,2]" if tier == "full" else "devices=["
            assert any(tiled in s for s in res["train"]["matrix_specs"]), res["train"]
    print(f"{group} tp: max |loss - one process| per case: {worst}")


TRANSFER = ROOT / "tests" / "distributed" / "transfer_worker.py"
# data-parallel variants that load the tp checkpoints at tp 1 (XLA loads them at tp 2 below: the
# same reader, kept out to hold the suite's time)
TARGETS = ("fsdp2", "zero2")


def transfer_setup(tmp, tier):
    """(sources, loaders, plan): every TP variant saves at tp 2 on 2 ranks or devices (dp 1,
    micro-batch 4); loaders are the TP variants at dp 2 x tp 2 and FSDP2 and ZeRO-2 at tp 1. make
    test: each backend's default TP variant (matrix.quick) as source and loader, once, round
    robin (each source into another backend where there is one); make test-full: every pair."""
    some = list if tier == "full" else matrix.quick  # make test: the default variants
    sources = {f"{c.name}-tp2": (c, with_tp(c, micro_batch_size=4))
               for c in some(tp_variants(world=2))}
    targets = [c for c in matrix.cases(world=2, micro_batch_size=2, every=True) if c.name in TARGETS]
    wide = some(tp_variants(world=4))
    loaders = {c.name: (c, c.spec) for c in targets}
    loaders.update({f"{c.name}-dp2-tp2": (c, with_tp(c)) for c in wide})
    if tier == "full":
        plan = {name: [f"{s}-adamw" for s in sources] for name in loaders}
    else:  # round robin, the loaders shifted by one: a source meets another backend's split
        names, plan = list(sources), {name: [] for name in loaders}
        for i, name in enumerate(loaders):
            plan[name].append(f"{names[(i + 1) % len(names)]}-adamw")
        for i, source in enumerate(names[len(loaders):]):  # sources left over, if any
            plan[list(loaders)[i]].append(f"{source}-adamw")
    specs = {**{n: s for n, (_, s) in sources.items()}, **{n: s for n, (_, s) in loaders.items()}}
    (tmp / "backends.json").write_text(json.dumps(specs))
    (tmp / "plan.json").write_text(json.dumps(plan))
    (tmp / "ckpt").mkdir(exist_ok=True)
    return sources, loaders, plan


def transfer_launches(tmp, tier):
    """(phase, names, the case whose launch they share): one launch per layout and phase."""
    sources, loaders, _ = transfer_setup(tmp, tier)
    out = []
    for group in matrix.by_launch([c for c, _ in sources.values()]):
        out.append(("save", [f"{c.name}-tp2" for c in group], group[0]))
    by_case = {id(c): n for n, (c, _) in loaders.items()}
    for group in matrix.by_launch([c for c, _ in loaders.values()]):
        out.append(("load", [by_case[id(c)] for c in group], group[0]))
    return out


def transfer_args(tmp, phase, names) -> list:
    return ["--phase", phase, "--backends", tmp / "backends.json", "--names", ",".join(names),
            "--root", tmp / "ckpt", "--out", tmp / f"{phase}-{names[0]}.json", "--plan",
            tmp / "plan.json", "--optimizers", "adamw"]


@needs_both
@pytest.mark.timeout(900)
@pytest.mark.parametrize("tier", ["quick", pytest.param("full", marks=pytest.mark.full)])
def test_tp_checkpoints_load_at_tp1_other_worlds_and_backends(request, tmp_path, tier):
    """Every TP variant's tp 2 checkpoint loads, with AdamW's moments and step counts, at dp 2 x tp
    2 (4 ranks or devices: another world size, and another backend's split) and at tp 1 on FSDP2
    and ZeRO-2: the uninterrupted run's losses (transfer_setup says which pairs)."""
    if tier == "quick":
        tmp, run = request.getfixturevalue("shared")[__name__]
        tmp = tmp / "transfers"
    else:  # make test-full: every pair, launches of its own
        tmp, run = tmp_path, None
        transfer_setup(tmp, tier)
        for phase, names, c in transfer_launches(tmp, tier):
            torchrun(c.nproc, [str(TRANSFER), *map(str, transfer_args(tmp, phase, names))],
                     timeout=300, env=c.env)
    sources, loaders, plan = transfer_setup(tmp, tier)
    saved, loaded = {}, {}
    for phase, names, _ in transfer_launches(tmp, tier):
        (saved if phase == "save" else loaded).update(
            read(tmp / f"{phase}-{names[0]}.json", run, "transfer_worker"))
    errors = {k: v["error"] for k, v in {**saved, **loaded}.items() if "error" in v}
    assert not errors, "\n\n".join(f"{k}:\n{v[-3000:]}" for k, v in errors.items())
    ref = saved["reference-adamw"]["loss"]
    pairs = 0
    assert len(sources) >= 2 and len(loaders) >= 4, (sources, loaders)
    for source in sources:
        assert max(abs(a - b) for a, b in zip(saved[f"{source}-adamw"]["loss"], ref[:3])) <= 1e-5
        hf = saved[f"{source}-adamw"]["hf"]  # save_pretrained of the tp 2 blocks: the saved weights
        assert hf["files"] >= 2 and not hf["names"] and not hf["differ"], (source, hf)
        # (each source resuming itself: the parity test above)
        for target in (t for t in loaders if f"{source}-adamw" in plan[t]):
            res = loaded[f"{source}->{target}-adamw"]
            assert res["start"] == 3, (source, target, res)
            diff = max(abs(a - b) for a, b in zip(res["loss"], ref[3:]))
            assert diff <= 1e-5, f"{source} -> {target}: {res['loss']} vs {ref[3:]}"
            pairs += 1
    assert pairs == sum(len(p) for p in plan.values())
    assert {s for p in plan.values() for s in p} == {f"{s}-adamw" for s in sources}
    print(f"{pairs} tp checkpoint transfers within 1e-5")


SEQUENTIAL = ROOT / "tests" / "distributed" / "sequential_worker.py"


# make test-full's: make test's shared 4-rank launch runs its TP jobs (FSDP2 with HSDP, ZeRO-3)
# one after another in the same processes too
@pytest.mark.full
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tier", ["quick", "full"])
def test_tp_jobs_one_after_another_in_one_process(tmp_path, tier):
    """A sweep or a notebook kernel runs jobs one after another: each TP variant that launches as
    torch processes (XLA's runtime is one client per process) runs dp 2 x tp 2 twice, each job
    closed before the next, all in one process per rank. Measured before: DeepSpeed's AutoTP groups
    and torch's flattened-mesh cache still pointed at the first job's destroyed process group."""
    group = next(g for g in matrix.by_launch(tp_variants()) if not g[0].env.get("CPU_NUM_DEVICES"))
    jobs = {}
    # make test: FSDP2 (with HSDP) and ZeRO-3; make test-full: every variant
    for c in (group if tier == "full" else [c for c in group if c.name in ("fsdp2", "zero3")]):
        jobs[f"{c.name}-first"] = jobs[f"{c.name}-again"] = with_tp(c)  # 4 ranks (dp 1 hid it)
        if c.name == "fsdp2":  # HSDP x TP: 2 replicas of 1 shard, the flattened dp group
            hsdp = with_tp(c, shard="hybrid")
            hsdp["topology"]["shard_group_size"] = 1
            jobs["fsdp2-hsdp-first"] = jobs["fsdp2-hsdp-again"] = hsdp
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    torchrun(group[0].nproc, [str(SEQUENTIAL), "--jobs", str(tmp_path / "jobs.json"), "--out",
                              str(tmp_path / "out.json")], timeout=240, env=group[0].env)
    results = json.loads((tmp_path / "out.json").read_text())
    assert list(results) == list(jobs), results
    bad = {k: v for k, v in results.items() if not isinstance(v, float) or v > 1e-5}
    assert not bad, bad


def test_lora_with_tensor_parallelism(shared):
    """#42: a PeftModel at tp 2 (LoRA on colwise and rowwise projections): the model's own plan
    carried into the LoRA layers (tp_plan.lora_parts), one process's losses on FSDP2; DeepSpeed's
    AutoTP, which leaves some LoRA layers whole, refused naming why."""
    tmp, run = shared[__name__]
    got = read(tmp / "lora.json", run, "lora_tp_worker")
    assert max(abs(a - b) for a, b in zip(got["fsdp2"]["loss"], got["reference"])) <= 1e-5, got
    # save_pretrained's one route (#65): each rank writes its TP pieces of the adapter in place, as
    # PeftModel.save_pretrained names them; from_pretrained gives the engine's eval loss
    assert got["adapter_files"] == ["adapter_config.json", "adapter_model.safetensors"], got
    assert abs(got["reloaded"] - got["fsdp2"]["eval"]) <= 1e-5, got
    assert isinstance(got["zero1"], str) and "LoRA" in got["zero1"] and "fsdp" in got["zero1"], got
