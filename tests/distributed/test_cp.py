"""Context parallelism (`topology.cp`) through the engine, against one process on the global batch.

Cases come from the registry: every variant (matrix.cases) whose spec with cp 2 validates (FSDP2 and
ZeRO-0/1/2/3; FSDP1 and XLA refuse it, unit-tested) runs cp 2 on 2 ranks with padded SFT rows (the
second half of a short row holds no target: a rank without targets), accumulation, clipping and
activation checkpointing on the tiny Llama, whose attention is grouped-query (4 heads, 2 key/value
heads), saving after step 3 and resuming in fresh processes; then dp 2 x cp 2 and tp 2 x cp 2 on 4
ranks, and a cp 2 checkpoint loaded at cp 1 on another backend."""

import matrix
import pytest
from harness import case, check_parity, parity_jobs, parity_results, run_parity

from parallel.spec.io import SpecError, load_spec

pytestmark = pytest.mark.distributed
BUDGET_S = 120  # seconds in make test (tests/conftest.py): the launches are shared


def with_cp(c, cp=2, tp=1, **extra):
    """A variant's spec (as matrix laid it out on this host) with context parallelism."""
    spec = {**c.spec, **extra}
    spec["topology"] = {**c.spec["topology"], "cp": cp, **({"tp": tp} if tp > 1 else {})}
    if tp > 1:
        spec["wrap"] = {"policy": "auto"}
    return spec


def cp_variants(world=2, tp=1):
    out = []
    for c in matrix.cases(world=world, micro_batch_size=2):
        try:
            load_spec(with_cp(c, tp=tp))
        except SpecError:  # the backend refuses cp (FSDP1, XLA): unit-tested
            continue
        out.append(c)
    return out


VARIANTS = {c.name: c for c in cp_variants()}
# the first data-parallel variant of each backend at 4 ranks: dp 2 x cp 2 and tp 2 x cp 2
WIDE = {c.backend: c for c in reversed(cp_variants(world=4))}
MHA = {"num_attention_heads": 4, "num_key_value_heads": 4}  # every head its own keys


def cases(c, tier="full"):
    """One variant's cp 2 cases at 2 ranks: make test ("quick") one case holding every option
    (padded rows, accumulation, clipping, checkpointing, AdamW, grouped-query attention) and the
    resume into cp 1 on another backend; make test-full also each option alone, multi-head
    attention, sdpa with the tiled loss, and compile."""
    everything = with_cp(c, micro_batch_size=1, grad_accum_steps=2, grad_clip=0.5,
                         activation_checkpointing=True)
    out = [case("padded-accum-clip-ac", everything, optimizer="adamw", padded=True)]
    if tier == "full":
        out += [case("cp2", with_cp(c), optimizer="adamw"),
                case("mha-padded", with_cp(c), padded=True, model=MHA),
                case("sdpa-tiled", with_cp(c, sequence={"loss_tile": 16}), optimizer="adamw",
                     padded=True, model={"attn_implementation": "sdpa"})]
        if c.name == "fsdp2":
            out.append(case("compile-blocks", with_cp(c, compile={"enabled": True,
                                                                  "scope": "blocks"})))
    return [{**one, "name": f"{c.name}-{one['name']}"} for one in out]


def transfer_cases():
    """A cp 2 checkpoint of each backend loaded at cp 1 (dp 2) on the other backend."""
    names = {c.backend: c for c in VARIANTS.values()}
    out = []
    for backend, c in names.items():
        other = next((o for b, o in names.items() if b != backend), c)
        # the same global batch: 2 rows, one per data-parallel rank at cp 1
        out.append({**case(f"{c.name}-to-{other.name}-cp1", with_cp(c), optimizer="adamw",
                           padded=True), "resume_spec": {**other.spec, "micro_batch_size": 1}})
    return out


def wide_cases():
    out = []
    for c in WIDE.values():
        out.append(case(f"{c.name}-dp2-cp2", with_cp(c), optimizer="adamw", padded=True))
        try:
            load_spec(with_cp(c, tp=2))
        except SpecError:
            continue
        # the tiny Llama at tp 2: one key/value head per rank, repeated for cp 2 (kv_repeat)
        out.append(case(f"{c.name}-tp2-cp2", with_cp(c, tp=2), optimizer="adamw", padded=True))
    return out


def shared_jobs(tmp):
    """make test's tier in the suite's shared launches (shared.py): the cp 2 cases of every
    variant and the transfers on 2 ranks, the wide layouts on 4."""
    narrow = [one for c in VARIANTS.values() for one in cases(c, "quick")] + transfer_cases()
    first = next(iter(VARIANTS.values()))
    wide = next(iter(WIDE.values()))
    return (parity_jobs(tmp, narrow, nproc=first.nproc, env=first.env, key="cp-2")
            + parity_jobs(tmp, wide_cases(), nproc=wide.nproc, env=wide.env, key="cp-4"))


def test_the_registry_has_cp_variants():
    assert {"fsdp2", "zero0", "zero1", "zero2", "zero3"} <= set(VARIANTS), sorted(VARIANTS)
    assert not {"fsdp1", "xla1", "xla2"} & set(VARIANTS), sorted(VARIANTS)
    # one launch holds them all (the same processes and environment)
    assert len(matrix.by_launch(list(VARIANTS.values()))) == 1


def _results(request, tmp_path, key, chosen, nproc, env, tier):
    if tier == "quick":
        tmp, run = request.getfixturevalue("shared")[__name__]
        return parity_results(tmp, run, key=key)
    return run_parity(tmp_path, chosen, nproc=nproc, timeout=500, env=env)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tier", ["quick", pytest.param("full", marks=pytest.mark.full)])
def test_cp2_matches_one_process_resumes_and_moves_to_cp1(request, tmp_path, tier):
    chosen = [one for c in VARIANTS.values() for one in cases(c, tier)] + transfer_cases()
    first = next(iter(VARIANTS.values()))
    results = _results(request, tmp_path, "cp-2", chosen, first.nproc, first.env, tier)
    assert sorted(results) == sorted(one["name"] for one in chosen)
    moved = {one["name"] for one in chosen if "resume_spec" in one}
    # another layout sums in another order: the one-process tolerance, not bit equality
    worst = {name: check_parity(name, res, resume_tol=1e-5 if name in moved else 0.0)
             for name, res in results.items()}
    print(f"cp 2: max |loss - one process| per case: {worst}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tier", ["quick", pytest.param("full", marks=pytest.mark.full)])
def test_dp2_cp2_and_tp2_cp2_match_one_process(request, tmp_path, tier):
    chosen = wide_cases()
    wide = next(iter(WIDE.values()))
    assert {one["name"] for one in chosen} >= {"fsdp2-dp2-cp2", "fsdp2-tp2-cp2"}, chosen
    results = _results(request, tmp_path, "cp-4", chosen, wide.nproc, wide.env, tier)
    worst = {name: check_parity(name, res) for name, res in results.items()}
    print(f"4 ranks with cp 2: max |loss - one process| per case: {worst}")
