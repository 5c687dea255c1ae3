"""Pipeline parallelism (`topology.pp`) through the engine, against one process on the global batch.

Cases come from the registry: every variant (matrix.cases) whose spec with pp 2 validates (FSDP2 and
DeepSpeed's ZeRO-0; FSDP1, XLA and the other ZeRO stages refuse it naming why, unit-tested in
tests/unit/test_pipeline_spec.py) runs each case whose spec it accepts: pp 2 on 2 ranks with padded
SFT rows (micro-batches hold different numbers of targets), on the tiny Llama (2 layers: a stage
each; 4 layers for interleaved_1f1b's 2 stages per rank), saving after step 3, loading its weights
alone and evaluating, then resuming in fresh processes:
- make test: 1f1b with accumulation, clipping and activation checkpointing; interleaved_1f1b; the
  same job under the schedule's default gradient scaling (each micro-batch's own mean: torch's, and
  DeepSpeed's train_batch's), which must differ from one process (the trap torchtitan#2972 is
  about); a model of your own (toy.OwnDecoder) split where pipeline.split_points says; a pp 2
  checkpoint resumed at pp 1 on ZeRO-3 and on XLA, and theirs at pp 2; save_pretrained's export
  read back by transformers; generate refused; torch's V-shaped schedules over fully_shard measured
  against one process (why polyshard refuses zbv and dualpipev on FSDP2), in a launch of its own.
- make test: pp 2 x cp 2 on 4 ranks too. make test-full: gpipe, each schedule alone, torch.compile,
  pp 2 x dp 2 and pp 2 x tp 2 on 4 ranks.
"""

import json

import matrix
import pytest
from harness import (
    ROOT,
    accepted,
    case,
    check_parity,
    parity_jobs,
    parity_results,
    run_parity,
    tier_results,
    torchrun,
)
from shared import job, read

pytestmark = pytest.mark.distributed
BUDGET_S = 55  # seconds in make test (tests/conftest.py): torch's V schedules' launch of its own
FOUR = {"num_hidden_layers": 4}  # 2 stages per rank at pp 2
OWN = {"pipeline": {"split_points": ["layers.1"]},  # toy.OwnDecoder: no _no_split_modules
       "wrap": {"policy": "layer_classes", "layer_classes": ["TransformerEncoderLayer"]}}


def with_pp(c, pp=2, tp=1, cp=1, **extra):
    """A variant's spec (as matrix laid it out on this host) with pipeline stages."""
    spec = {**c.spec, **extra}
    spec["topology"] = {**c.spec["topology"], "pp": pp, **({"tp": tp} if tp > 1 else {}),
                        **({"cp": cp} if cp > 1 else {})}
    return spec


def pp_variants(world=2):
    return matrix.accepting(with_pp, world)


VARIANTS = {c.name: c for c in pp_variants()}
GROUPS = {"+".join(c.name for c in group): group for group in matrix.by_launch(pp_variants())}
WIDE = {"+".join(c.name for c in group): group for group in matrix.by_launch(pp_variants(4))}


def zero3(c):
    """The ZeRO-3 variant that launches as `c` does: where a pp checkpoint resumes at pp 1."""
    return next((o for o in matrix.cases(world=c.nproc, micro_batch_size=1, every=True)
                 if o.name == "zero3" and o.launch == c.launch), None)


def cases(c, tier="quick"):
    everything = with_pp(c, grad_accum_steps=2, grad_clip=0.5, activation_checkpointing=True)
    out = [case("1f1b-padded-accum-clip-ac", everything, optimizer="adamw", padded=True,
                pretrained=True, generate_refused=True),
           case("interleaved-padded", with_pp(c, pipeline={"schedule": "interleaved_1f1b"}),
                optimizer="adamw", padded=True, model=FOUR),
           case("default-scaling", with_pp(c), optimizer="adamw", padded=True,
                default_scaling=True),
           case("own-model-split-points", with_pp(c, **OWN), optimizer="adamw", padded=True,
                model={"own": 2})]
    other = zero3(c)
    if other is not None:  # the same global batch: 2 rows, one per data-parallel rank at pp 1
        out += [{**case("to-zero3-pp1", with_pp(c), optimizer="adamw", padded=True),
                 "resume_spec": other.spec},
                {**case("from-zero3-pp1", other.spec, optimizer="adamw", padded=True),
                 "resume_spec": with_pp(c)}]
    if tier == "full":
        out += [case(f"{s}-padded", with_pp(c, pipeline={"schedule": s}), optimizer="adamw",
                     padded=True, model=FOUR if s == "interleaved_1f1b" else {})
                for s in ("gpipe", "1f1b", "interleaved_1f1b")]
        out.append(case("compiled", with_pp(c, compile={"enabled": True}), optimizer="adamw",
                        padded=True))
        out.append(case("interleaved-accum-clip", with_pp(
            c, pipeline={"schedule": "interleaved_1f1b"}, grad_accum_steps=2, grad_clip=0.5),
            model=FOUR))
    return [{**one, "name": f"{c.name}-{one['name']}"} for one in out if accepted(one)]


def wide_cases(c, tier="full"):
    """4 ranks. make test: pp 2 x cp 2 (the last stage's targets come shifted from cp's split; it
    once took them shifted twice, 1.23 off, and exited 0); make test-full: pp 2 x dp 2, pp 2 x tp 2."""
    chosen = (("pp2-cp2", with_pp(c, cp=2)),) if tier == "quick" else (
        ("pp2-dp2-accum-clip", with_pp(c, grad_accum_steps=2, grad_clip=0.5)),
        ("pp2-tp2", with_pp(c, tp=2, wrap={"policy": "auto"})))
    return [{**case(name, spec, optimizer="adamw", padded=True), "name": f"{c.name}-{name}"}
            for name, spec in chosen if accepted({"spec": spec})]


def xla_variant():
    """XLA's variant that takes the same global batch (2 rows): SPMD on 2 devices if registered."""
    found = [o for o in matrix.cases(world=2, micro_batch_size=1, every=True)
             if o.backend == "xla_fsdp"]
    return next((o for o in found if o.name == "xla2"), found[0] if found else None)


def moves(c):
    """(case, the variant that trains and saves, the one that resumes) between pp 2 and XLA at pp
    1, each phase in its own backend's launch (XLA's is one process driving its devices)."""
    x = xla_variant()
    if x is None:
        return []
    to = {**case(f"{c.name}-to-{x.name}-pp1", with_pp(c), optimizer="adamw", padded=True),
          "resume_spec": x.spec}
    back = {**case(f"{c.name}-from-{x.name}-pp1", x.spec, optimizer="adamw", padded=True),
            "resume_spec": with_pp(c)}
    return [(to, c, x), (back, x, c)]


def move_jobs(tmp):
    jobs = []
    for one, writer, reader in (m for group in GROUPS.values() for c in group for m in moves(c)):
        cases_file = tmp / f"{one['name']}.json"
        cases_file.write_text(json.dumps([one]))
        for phase, who in ((1, writer), (2, reader)):
            name = "train" if phase == 1 else "resume"
            jobs.append(job("parity_worker", ["--cases", cases_file, "--phase", name,
                                              "--ckpt-root", tmp / "moves", "--out",
                                              tmp / f"{one['name']}-{name}.json"],
                            who.nproc, who.env, phase))
    return jobs


def key(prefix, group_name):
    return f"{prefix}-{group_name.replace('+', '-')}"


def shared_jobs(tmp):
    jobs = move_jobs(tmp)
    for name, group in GROUPS.items():
        chosen = [one for c in group for one in cases(c)]
        jobs += parity_jobs(tmp, chosen, nproc=group[0].nproc, env=group[0].env,
                            key=key("pp-2", name))
    for name, group in WIDE.items():
        chosen = [one for c in group for one in wide_cases(c, "quick")]
        jobs += parity_jobs(tmp, chosen, nproc=group[0].nproc, env=group[0].env,
                            key=key("pp-4", name))
    return jobs


def test_the_registry_has_pp_variants():
    assert set(VARIANTS) == {"fsdp2", "zero0"}, sorted(VARIANTS)


def check(results, chosen):
    assert sorted(results) == sorted(one["name"] for one in chosen)
    worst = {}
    for one in chosen:
        name, res = one["name"], results[one["name"]]
        if one.get("default_scaling"):  # the schedule's default: a mean of micro-batch means
            train = res["train"]
            assert "error" not in train, train["error"]
            off = max(abs(a - b) for a, b in zip(train["loss"], train["ref_loss"]))
            assert off > 1e-4, f"{name}: the schedule's default scaling matched one process ({off:.1e})"
            worst[name] = f"differs by {off:.1e} (the trap)"
            continue
        moved = "resume_spec" in one  # another layout sums in another order
        worst[name] = check_parity(name, res, resume_tol=1e-5 if moved else 0.0)
        train = res["train"]
        assert abs(train["consolidated_loss"] - train["loss"][3]) <= 1e-5, (name, train)
        if one.get("pretrained"):
            assert abs(train["pretrained_loss"] - train["loss"][3]) <= 1e-5, (name, train)
        if one.get("generate_refused"):
            assert "save_pretrained" in train["generate_refused"], train
    return worst


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tier", ["quick", pytest.param("full", marks=pytest.mark.full)])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_pp2_matches_one_process_resumes_and_moves_to_pp1(request, tmp_path, group, tier):
    chosen = [one for c in GROUPS[group] for one in cases(c, tier)]
    results = tier_results(request, tmp_path, __name__, key("pp-2", group), chosen,
                           GROUPS[group][0], tier)
    print(f"pp 2 ({group}): max |loss - one process| per case: {check(results, chosen)}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("group", sorted(WIDE))
def test_pp2_cp2_matches_one_process(request, group):
    tmp, run = request.getfixturevalue("shared")[__name__]
    chosen = [one for c in WIDE[group] for one in wide_cases(c, "quick")]
    results = parity_results(tmp, run, key=key("pp-4", group))
    print(f"pp 2 x cp 2 ({group}): max |loss - one process|: {check(results, chosen)}")


@pytest.mark.full
@pytest.mark.timeout(900)
@pytest.mark.parametrize("group", sorted(WIDE))
def test_pp2_dp2_and_pp2_tp2_match_one_process(tmp_path, group):
    chosen = [one for c in WIDE[group] for one in wide_cases(c)]
    results = run_parity(tmp_path, chosen, nproc=WIDE[group][0].nproc, timeout=800,
                         env=WIDE[group][0].env)
    print(f"4 ranks with pp 2 ({group}): max |loss - one process| per case: "
          f"{check(results, chosen)}")


def test_a_pp2_checkpoint_resumes_on_xla_at_pp1_and_back(request):
    """Optimizer state included, the losses continuing within 1e-5 (another layout sums in
    another order), each backend in its own launch."""
    tmp, run = request.getfixturevalue("shared")[__name__]
    chosen = [one for group in GROUPS.values() for c in group for one, _, _ in moves(c)]
    assert chosen, "no XLA variant registered"
    worst = {}
    for one in chosen:
        res = {phase: read(tmp / f"{one['name']}-{phase}.json", run, "parity_worker")[one["name"]]
               for phase in ("train", "resume")}
        worst[one["name"]] = check_parity(one["name"], res, resume_tol=1e-5)
    print(f"pp 2 <-> XLA pp 1: max |loss - one process| per case: {worst}")


def test_torch_v_schedules_over_fully_shard_still_differ(tmp_path):
    """The measured reason zbv and dualpipev are refused on FSDP2 (pipeline_v_worker.py): plain
    stages match one process under every schedule, fully_shard stages under interleaved_1f1b only.
    A launch of its own: in the suite's shared launch zbv's weight-gradient pass raised instead."""
    torchrun(2, [str(ROOT / "tests" / "distributed" / "pipeline_v_worker.py"), "--out",
                 str(tmp_path / "v.json")], 200)
    found = json.loads((tmp_path / "v.json").read_text())

    def off(mine, whole):
        return float("inf") if mine is None or whole is None else abs(mine - whole) / whole

    worst = {k: max(off(*v) for v in stages.values()) for k, stages in found.items()}
    print(f"torch's schedules, max relative gradient-norm error per stage: {worst}")
    assert all(worst[k] < 1e-5 for k in worst if k.endswith("-plain")), worst
    assert worst["interleaved_1f1b-fsdp2"] < 1e-5, worst
    assert worst["zbv-fsdp2"] > 1e-3 and worst["dualpipev-fsdp2"] > 1e-3, (
        f"torch's V schedules now match over fully_shard: lift the refusal in "
        f"backends/fsdp/translate.py and test them in cases() ({worst})")
