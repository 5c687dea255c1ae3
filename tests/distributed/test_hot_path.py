"""A steady-state step costs what the native loop's step costs: counted per step, never timed
(parallel/tools/bench/counting.py counts both sides by one rule). For every variant in the registry
that has a hand-written loop (FSDP2, FSDP1, ZeRO-0/1/2/3 at 2 gloo ranks, XLA FSDP v1 on the CPU
client's 1 process, FSDP2 at tp 2 against torchtitan's apply_tp by hand and at pp 2 against
torchtitan's pipelining by hand, ZeRO-0 at pp 2 against DeepSpeed's pipeline tutorial's loop),
against the hand-written loop in benchmarks/ running the same job: the same collectives op for op
(less what a library's own loop pays beyond the step, LOOP_EXTRA), zero store calls, and
device-to-host reads equal to the native loop's when the loop reads the loss every step (as the
native loop does), one fewer when it does not (on_nonfinite: raise_deferred, the default); with
on_nonfinite: raise the step's own read replaces the loop's. XLA runs the same number of graphs
per step; raise cuts its step in two (the read before the update): counted and recorded. Context
parallelism (cp 2, every variant that has it): against DeepSpeed's own Ulysses loop
(native_deepspeed.py --sp, its ALST tutorial's) the same all-to-alls and fewer collectives and host
reads; every cp variant exactly its data-parallel loop plus those all-to-alls."""

import dataclasses
import json

import matrix
import pytest
from harness import ROOT, needs_both
from shared import job, read
from reliability import record

from parallel.registry import get
from parallel.spec.io import SpecError, load_spec
from parallel.tools.bench.report import NATIVE_DIR

pytestmark = pytest.mark.distributed
BUDGET_S = 30  # seconds in make test (tests/conftest.py)

DIST = ROOT / "tests" / "distributed"
ROWS = 4  # global rows per step
# every variant in the registry with a hand-written loop for its spec (descriptor.bench.native)
CASES = [dataclasses.replace(c, spec={**c.spec, "grad_clip": 1.0})
         for c in matrix.cases(world=2, micro_batch_size=ROWS // 2)
         if get(c.backend).bench.native(load_spec(c.spec)) is not None]


def with_dim(c, dim: str, degree: int = 2):
    """The variant at tp 2, cp 2 or pp 2 on the same ranks (dp 1: every rank all rows), where it has
    that dimension (else None: the refusals are tests/unit/test_dims.py's)."""
    spec = {**c.spec, "micro_batch_size": ROWS,
            "topology": {**c.spec["topology"], dim: degree}}
    try:
        load_spec(spec)
    except SpecError:
        return None
    return dataclasses.replace(c, name=f"{c.name}-{dim}{degree}", spec=spec)


# and each of them that splits, at tp 2 against the loop's torchtitan-style --tp; at pp 2 each
# backend's default variant where it pipelines, else its first that does (DeepSpeed: ZeRO-0),
# against its torchtitan-style pipelining (native_pipeline.py) or DeepSpeed's pipeline tutorial
DATA_PARALLEL = list(CASES)
CASES += [t for c in DATA_PARALLEL if (t := with_dim(c, "tp")) is not None]
PIPELINED = [c for c in matrix.cases(world=2, micro_batch_size=ROWS // 2, every=True)
             if get(c.backend).bench.native(load_spec(c.spec)) is not None
             and with_dim(c, "pp") is not None]
CASES += [with_dim(c, "pp") for c in matrix.quick(PIPELINED)]
# cp 2 where the registry's backend has it. The first with a hand-written Ulysses loop runs against
# it (native_deepspeed.py --sp: DeepSpeed's own, once per process: its sequence-parallel group is a
# module global made once); every other one (COMPOSED) is counted against its data-parallel loop plus
# those exchanges (no hand-written FSDP2 loop runs Ulysses: torchtitan's context parallelism is ring
# attention on CUDA SDPA)
SPLIT = [t for c in DATA_PARALLEL if (t := with_dim(c, "cp")) is not None]
ULYSSES = next(t for t in SPLIT if get(t.backend).bench.native(load_spec(t.spec)) is not None)
CASES.append(ULYSSES)
COMPOSED = {t.name: t for t in SPLIT if t is not ULYSSES}
GROUPS = matrix.by_launch(CASES)
# on_nonfinite: raise, beside the default, for the first case of each launch group
RAISE = {f"{g[0].name}-raise": g[0].name for g in GROUPS}
BY_NAME = {c.name: c for c in CASES}


def shared_jobs(tmp):
    """Every case's engine, and one with on_nonfinite: raise, per launch group, in the suite's
    shared launches (shared.py); the cp cases without a loop of their own ride the group that
    launches as they do."""
    jobs = []
    for group in GROUPS:
        cases = {c.name: c.spec for c in group}
        cases.update({name: c.spec for name, c in COMPOSED.items() if c.launch == group[0].launch})
        cases[f"{group[0].name}-raise"] = {**group[0].spec, "on_nonfinite": "raise"}
        (tmp / f"cases-{group[0].name}.json").write_text(json.dumps(cases))
        jobs.append(job("hot_path_worker", ["--cases", tmp / f"cases-{group[0].name}.json",
                                            "--rows", ROWS, "--out",
                                            tmp / f"engine-{group[0].name}.json"],
                        group[0].nproc, group[0].env))
        jobs.append(native_job(tmp, group))
    return jobs + muon_jobs(tmp) + fp8_jobs(tmp)


# torch.optim.Muon + AdamW on FSDP2 (docs/optimizers.md), against the native loop that gathers each
# matrix at an owner rank and scatters it back (native_fsdp2.py --muon)
MUON = next(c for c in DATA_PARALLEL if c.name == "fsdp2")


def side_jobs(tmp, name: str, spec: dict, engine_args=(), native_flags=()) -> list:
    """A counted FSDP2 job of its own beside the launch groups (muon, fp8): the engine's, with
    `engine_args` for hot_path_worker, and the native loop the descriptor names for `spec`, with
    `native_flags` added."""
    (tmp / f"cases-{name}.json").write_text(json.dumps({name: spec}))
    script, flags = get(MUON.backend).bench.native(load_spec(spec))
    (tmp / f"native-{name}-cases.json").write_text(json.dumps({name: native_argv(
        script, [*flags, *native_flags], tmp / f"native-{name}-loop.json")}))
    return [job("hot_path_worker", ["--cases", tmp / f"cases-{name}.json", "--rows", ROWS,
                                    *engine_args, "--out", tmp / f"engine-{name}.json"],
                MUON.nproc, MUON.env),
            job(str(NATIVE_DIR / "cases.py"), ["--cases", tmp / f"native-{name}-cases.json",
                                               "--out", tmp / f"native-{name}.json"],
                MUON.nproc, MUON.env)]


def muon_jobs(tmp) -> list:
    return side_jobs(tmp, "muon", MUON.spec, ["--optimizer", "muon"], ["--muon"])


# precision: fp8 on FSDP2 with the float8 all-gather (docs/precision.md), against the native loop
# written as torchtitan's float8 docs write it (native_fsdp2.py --fp8)
FP8 = {**MUON.spec, "precision": "fp8", "float8": {"base": "fp32", "all_gather": True}}


def fp8_jobs(tmp) -> list:
    return side_jobs(tmp, "fp8", FP8)


def native_argv(script: str, flags: list, out) -> list:
    """A hand-written loop's command line, counted: 2 warm-up steps, then 3."""
    return [script, "--model=toy:tiny", "--steps=3", "--warmup=2", "--seq=16",
            f"--global-rows={ROWS}", "--clip=1.0", "--count", *flags, f"--out={out}"]


def native_job(tmp, group):
    """Every case of a launch group's hand-written loop, counted in one job (benchmarks/cases.py:
    the loops one after another, each as its script's main runs it)."""
    jobs = {}
    for c in group:
        script, flags = get(c.backend).bench.native(load_spec(c.spec))
        jobs[c.name] = native_argv(script, flags, tmp / f"native-{c.name}.json")
    (tmp / f"native-{group[0].name}-cases.json").write_text(json.dumps(jobs))
    return job(str(NATIVE_DIR / "cases.py"), ["--cases", tmp / f"native-{group[0].name}-cases.json",
                                              "--out", tmp / f"native-{group[0].name}.json"],
               group[0].nproc, group[0].env)


def native_counts(tmp, group, run) -> dict:
    raw = read(tmp / f"native-{group[0].name}.json", run, str(NATIVE_DIR / "cases.py"))
    out = {}
    for c in group:
        steps = raw[c.name]["counts"]
        assert all(s == steps[0] for s in steps), (c.name, steps)  # steady: every counted step
        out[c.name] = dict(sorted(steps[0].items()))
    return out


def split(counts: dict) -> tuple[dict, int, int]:
    collectives = {k: v for k, v in counts.items() if k.startswith("collective:")}
    return collectives, counts.get("host_reads", 0), counts.get("xla_graphs", 0)


# What a library's own loop pays beyond the step itself, by (backend, dimension): DeepSpeed's
# train_batch (its pipeline tutorial's loop) broadcasts the mean loss from the last stage to the
# pipeline's other ranks every step, where polyshard's one loss reduction serves every rank.
LOOP_EXTRA = {("deepspeed", "pp2"): {"collective:broadcast_": 1}}


def without_extra(name: str, collectives: dict) -> dict:
    extra = LOOP_EXTRA.get((BY_NAME[name].backend, name.rpartition("-")[2]), {})
    out = {k: v - extra.get(k, 0) for k, v in collectives.items()}
    return {k: v for k, v in out.items() if v}


@pytest.fixture(scope="module")
def counted(shared):
    tmp, run = shared[__name__]
    engine = {}
    for group in GROUPS:
        engine.update(read(tmp / f"engine-{group[0].name}.json", run, "hot_path_worker"))
    native = {}
    for group in GROUPS:
        native.update(native_counts(tmp, group, run))
    return engine, native


@needs_both
@pytest.mark.timeout(1200)
def test_a_step_pays_what_the_native_loop_pays(counted):
    engine, native = counted
    rows = []
    for name in BY_NAME:
        if name.endswith("-cp2"):
            continue  # test_cp_pays_ulysses_exchanges_and_nothing_more
        ours, theirs = engine[name], native[name]
        for mode in ("read", "noread"):
            assert not any(k.startswith("store") for k in ours[mode]), (name, ours[mode])
        assert not any(k.startswith("store") for k in theirs), (name, theirs)
        coll, reads, graphs = split(theirs)
        coll = without_extra(name, coll)
        assert split(ours["read"]) == (coll, reads, graphs), (name, ours["read"], theirs)
        assert split(ours["noread"]) == (coll, reads - 1, graphs), (name, ours["noread"], theirs)
        rows.append({"backend": name, "collectives per step": sum(coll.values()),
                     "native host reads": reads, "polyshard, loss read": split(ours["read"])[1],
                     "polyshard, loss never read": split(ours["noread"])[1],
                     "store calls": 0, "xla graphs": graphs or "-"})
    record("hot-path", {"rows": rows, "raise": {k: engine[k] for k in RAISE}})


@needs_both
@pytest.mark.timeout(1200)
def test_raise_and_skip_read_once_before_the_update(counted):
    engine, native = counted
    for name, base in RAISE.items():
        coll, reads, graphs = split(native[base])
        coll = without_extra(base, coll)
        for mode in ("read", "noread"):  # the step's own read serves the loop's: one either way
            assert split(engine[name][mode])[:2] == (coll, reads), (name, mode, engine[name])
        # where steps are compiled graphs (XLA), the read before the update ends the step's graph
        # early: the update is a second graph
        graphs = split(native[base])[2]
        assert split(engine[name]["noread"])[2] == graphs + (1 if graphs else 0), (name, engine)


ALL_TO_ALL = "collective:alltoall_base_"


@needs_both
@pytest.mark.timeout(1200)
def test_cp_pays_ulysses_exchanges_and_nothing_more(counted):
    """cp 2 on 2 ranks. Against DeepSpeed's own Ulysses loop (its ALST tutorial's: the same
    all-to-alls, plus position ids gathered in every layer and the ranks' losses gathered for the
    guide's weighted mean, where polyshard shifts labels before the split and counts targets in its
    one reduction): the same all-to-alls, no more collectives in all, no more host reads. FSDP2,
    which no hand-written loop runs with Ulysses: its native data-parallel loop's collectives and
    host reads exactly, plus DeepSpeed's Ulysses all-to-alls."""
    engine, native = counted
    ours, theirs = engine[ULYSSES.name], native[ULYSSES.name]
    coll, reads, _ = split(theirs)
    mine, my_reads, _ = split(ours["read"])
    # 2 layers x (forward + backward) x (q, k, v, output)
    assert mine[ALL_TO_ALL] == coll[ALL_TO_ALL] == 16, (ours, theirs)
    assert sum(mine.values()) <= sum(coll.values()) and my_reads <= reads, (ours, theirs)
    for mode in ("read", "noread"):
        assert not any(k.startswith("store") for k in ours[mode]), ours
    assert COMPOSED and all(not name.startswith("xla") for name in COMPOSED), sorted(COMPOSED)
    for name, c in COMPOSED.items():
        base = name.removesuffix("-cp2")
        coll, reads, graphs = split(native[base])
        expected = {**coll, ALL_TO_ALL: 16}
        assert split(engine[name]["read"]) == (expected, reads, graphs), (name, engine[name],
                                                                           native[base])
        assert split(engine[name]["noread"]) == (expected, reads - 1, graphs), name
    record("hot-path-cp", {"ulysses loop": ULYSSES.name, "native": theirs,
                           **{name: engine[name]["read"] for name in [ULYSSES.name, *COMPOSED]}})


@needs_both
@pytest.mark.timeout(1200)
def test_muon_pays_fewer_collectives_than_a_native_owner_loop(shared, counted):
    """Muon + AdamW on FSDP2 at 2 ranks: the AdamW loop's collectives and host reads plus two
    all-to-alls a step (one process group), where the native loop gathers and scatters each of the
    hidden matrices (2 x 14 on the tiny Llama); no store call."""
    tmp, run = shared[__name__]
    ours = read(tmp / "engine-muon.json", run, "hot_path_worker")["muon"]
    steps = read(tmp / "native-muon.json", run, str(NATIVE_DIR / "cases.py"))["muon"]["counts"]
    assert all(s == steps[0] for s in steps), steps
    theirs = dict(sorted(steps[0].items()))
    adamw = split(counted[1][MUON.name])[0]  # the native AdamW loop of the same job
    coll, reads, _ = split(ours["read"])
    assert coll == {**adamw, ALL_TO_ALL: adamw.get(ALL_TO_ALL, 0) + 2}, (coll, adamw)
    native_coll, native_reads, _ = split(theirs)
    assert native_coll.get("collective:gather_", 0) == native_coll.get("collective:scatter_", 0) \
        == 14, theirs
    assert sum(coll.values()) < sum(native_coll.values()) and reads <= native_reads, (ours, theirs)
    assert not any(k.startswith("store") for k in [*ours["read"], *theirs]), (ours, theirs)
    record("hot-path-muon", {"polyshard": ours["read"], "native owner loop": theirs})


@needs_both
@pytest.mark.timeout(1200)
def test_fp8_pays_what_torchtitans_float8_loop_pays(shared, counted):
    """precision: fp8 with the float8 all-gather on FSDP2 at 2 ranks: the native float8 loop's
    collectives op for op (its gathers, reductions and the one all-reduce of the weights' amaxes
    after each optimizer step, one more than the AdamW loop's), its host reads, no store call."""
    tmp, run = shared[__name__]
    ours = read(tmp / "engine-fp8.json", run, "hot_path_worker")["fp8"]
    steps = read(tmp / "native-fp8.json", run, str(NATIVE_DIR / "cases.py"))["fp8"]["counts"]
    assert all(s == steps[0] for s in steps), steps
    theirs = split(dict(sorted(steps[0].items())))
    adamw = split(counted[1][MUON.name])[0]
    assert split(ours["read"]) == theirs and split(ours["noread"])[1] == theirs[1] - 1, (ours, theirs)
    assert sum(theirs[0].values()) == sum(adamw.values()) + 1, (theirs, adamw)
    assert not any(k.startswith("store") for k in [*ours["read"], *steps[0]]), (ours, steps[0])
    record("hot-path-fp8", {"polyshard": ours["read"], "native float8 loop": steps[0]})
