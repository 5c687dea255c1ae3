"""Context parallelism (`topology.cp`) through the engine, against one process on the global batch.

Cases come from the registry: every variant (matrix.cases) whose spec with cp 2 validates (FSDP2,
ZeRO-0/1/2/3 and XLA SPMD, whose mesh gets a seq axis; FSDP1 and XLA v1 refuse it, unit-tested; make
test: each backend's default one, matrix.quick: FSDP2, ZeRO-3, XLA SPMD) runs cp 2 on 2 ranks or
devices with padded SFT rows (the second half of a short row holds no target: a rank without
targets), accumulation, clipping and activation checkpointing on the tiny Llama, whose attention is
grouped-query (4 heads, 2 key/value heads), saving after step 3 and resuming in fresh processes;
then dp 2 x cp 2 and tp 2 x cp 2 on 4 ranks or devices, and a cp 2 checkpoint loaded at cp 1 on
another backend of the same launch (XLA SPMD: at cp 1 with its devices on the fsdp axis)."""

import matrix
import pytest
from harness import case, check_parity, parity_jobs, parity_results, run_parity

from parallel.spec.io import SpecError, load_spec

pytestmark = pytest.mark.distributed
BUDGET_S = 30  # seconds in make test (tests/conftest.py): the launches are shared


def with_cp(c, cp=2, tp=1, **extra):
    """A variant's spec (as matrix laid it out on this host) with context parallelism."""
    spec = {**c.spec, **extra}
    spec["topology"] = {**c.spec["topology"], "cp": cp, **({"tp": tp} if tp > 1 else {})}
    if tp > 1:
        spec["wrap"] = {"policy": "auto"}
    return spec


def cp_variants(world=2, tp=1):
    # the backends that refuse cp (FSDP1, XLA): unit-tested
    return matrix.accepting(lambda c: with_cp(c, tp=tp), world)


VARIANTS = {c.name: c for c in cp_variants()}
GROUPS = {"+".join(c.name for c in group): group for group in matrix.by_launch(cp_variants())}
# the first variant of each backend at 4 ranks or devices: dp 2 x cp 2 and tp 2 x cp 2
WIDE = {c.backend: c for c in reversed(cp_variants(world=4))}
WIDE_GROUPS = {"+".join(c.name for c in group): group
               for group in matrix.by_launch(list(WIDE.values()))}
# the wide layouts (4 ranks or devices) run in make test-full: a 4-rank launch of its own and
# 29 s of jobs here, where make test's cp 2 cases of every variant and the dry run of the 8B's
# tp 8 x cp 4 layout (test_dryrun.py) stay
QUICK_WIDE: set[str] = set()
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


def transfer_cases(group):
    """A cp 2 checkpoint of each backend of a launch group loaded at cp 1 (dp 2) on another
    backend of the group (itself where it is alone: XLA SPMD, another layout of its devices)."""
    names = {c.backend: c for c in group}
    out = []
    for backend, c in names.items():
        other = next((o for b, o in names.items() if b != backend), c)
        # the same global batch: 2 rows, one per data-parallel rank at cp 1
        out.append({**case(f"{c.name}-to-{other.name}-cp1", with_cp(c), optimizer="adamw",
                           padded=True), "resume_spec": {**other.spec, "micro_batch_size": 1}})
    return out


def wide_cases(group):
    out = []
    for c in group:
        out.append(case(f"{c.name}-dp2-cp2", with_cp(c), optimizer="adamw", padded=True))
        try:
            load_spec(with_cp(c, tp=2))
        except SpecError:
            continue
        # the tiny Llama at tp 2: one key/value head per rank, repeated for cp 2 (kv_repeat)
        out.append(case(f"{c.name}-tp2-cp2", with_cp(c, tp=2), optimizer="adamw", padded=True))
    return out


def narrow_cases(group, tier):
    """make test: each backend's default variant (matrix.quick: FSDP2, ZeRO-3, XLA SPMD);
    make test-full: every variant of the group."""
    group = group if tier == "full" else matrix.quick(group)
    return [one for c in group for one in cases(c, tier)] + transfer_cases(group)


def key(prefix, group_name):
    return f"{prefix}-{group_name.replace('+', '-')}"


def shared_jobs(tmp):
    """make test's tier in the suite's shared launches (shared.py): per launch group, the cp 2
    cases of each backend's default variant and the transfers on 2 ranks or devices, the wide layouts on 4."""
    jobs = []
    for name, group in GROUPS.items():
        jobs += parity_jobs(tmp, narrow_cases(group, "quick"), nproc=group[0].nproc,
                            env=group[0].env, key=key("cp-2", name))
    for name, group in WIDE_GROUPS.items():
        if name not in QUICK_WIDE:
            continue
        jobs += parity_jobs(tmp, wide_cases(group), nproc=group[0].nproc, env=group[0].env,
                            key=key("cp-4", name))
    return jobs


def test_the_registry_has_cp_variants():
    assert {"fsdp2", "zero0", "zero1", "zero2", "zero3", "xla2"} <= set(VARIANTS), sorted(VARIANTS)
    assert not {"fsdp1", "xla1"} & set(VARIANTS), sorted(VARIANTS)
    assert set(WIDE) == {"fsdp", "deepspeed", "xla_fsdp"}, sorted(WIDE)


def _results(request, tmp_path, prefix, name, chosen, group, tier):
    if tier == "quick":
        tmp, run = request.getfixturevalue("shared")[__name__]
        return parity_results(tmp, run, key=key(prefix, name))
    return run_parity(tmp_path, chosen, nproc=group[0].nproc, timeout=500, env=group[0].env)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tier", ["quick", pytest.param("full", marks=pytest.mark.full)])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_cp2_matches_one_process_resumes_and_moves_to_cp1(request, tmp_path, group, tier):
    chosen = narrow_cases(GROUPS[group], tier)
    results = _results(request, tmp_path, "cp-2", group, chosen, GROUPS[group], tier)
    assert sorted(results) == sorted(one["name"] for one in chosen)
    moved = {one["name"] for one in chosen if "resume_spec" in one}
    # another layout sums in another order: the one-process tolerance, not bit equality
    worst = {name: check_parity(name, res, resume_tol=1e-5 if name in moved else 0.0)
             for name, res in results.items()}
    print(f"cp 2 ({group}): max |loss - one process| per case: {worst}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("group,tier", [
    *((g, "quick") for g in sorted(QUICK_WIDE)),
    *(pytest.param(g, "full", marks=pytest.mark.full) for g in sorted(WIDE_GROUPS))])
def test_dp2_cp2_and_tp2_cp2_match_one_process(request, tmp_path, group, tier):
    chosen = wide_cases(WIDE_GROUPS[group])
    assert any(one["name"].endswith("-tp2-cp2") for one in chosen), chosen
    results = _results(request, tmp_path, "cp-4", group, chosen, WIDE_GROUPS[group], tier)
    worst = {name: check_parity(name, res) for name, res in results.items()}
    print(f"4 ranks with cp 2 ({group}): max |loss - one process| per case: {worst}")
