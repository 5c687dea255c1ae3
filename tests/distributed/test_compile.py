"""torch.compile on FSDP2, FSDP1, ZeRO-2 and ZeRO-3, 2 gloo ranks, inductor's C++ backend: 5 AdamW steps
match a single eager process to the suite's fp32 tolerance, every compiled unit ran compiled code (none
fell back to eager), nothing compiled after warm-up, and steps 4-5 after a save at step 3 and a load
into fresh processes (compiling again) equal the uninterrupted compiled run exactly."""

import pytest
from harness import case, check_parity, needs_deepspeed, parity_jobs, parity_results
from matrix import FULL

pytestmark = pytest.mark.distributed
BUDGET_S = 30  # seconds in make test (tests/conftest.py)

BASE = {"topology": {"procs_per_node": 2}, "micro_batch_size": 2}
UNITS = 2  # toy:tiny's decoder layers, the units wrap.policy auto selects


def compiled(backend, scope="blocks", **extra):
    return {**BASE, "backend": backend, "compile": {"enabled": True, "scope": scope}, **extra}


def check(results, cases):
    for c in cases:
        res = results[c["name"]]
        diff = check_parity(c["name"], res)
        for phase in ("train", "resume"):
            stats = res[phase]["compile"]
            units = UNITS if c["spec"]["compile"]["scope"] == "blocks" else 1
            assert stats["units"] == units and stats["ran_compiled"] == units, (c["name"], stats)
            assert stats["eager"] == [] and stats["late_graphs"] == 0, (c["name"], stats)
            assert stats["graphs"] >= 1 and stats["compile_s"] > 0, (c["name"], stats)
        print(f"{c['name']}: max |loss - eager reference| {diff:.2e}, "
              f"{res['train']['compile']['graphs']} graphs, "
              f"{res['train']['compile']['graph_breaks']} breaks, "
              f"{res['train']['compile']['compile_s']:.1f} s compiling")


# make test: FSDP2's blocks (compiling costs 20 s a phase on a 2-core host; compile over TP and
# cp is test_tp's and test_cp's make test-full tier); make test-full (matrix.FULL) every variant
CASES = [
    # activation checkpointing and accumulation: the wrapper is what compiles, no_sync around it
    case("fsdp2-blocks-ac-accum", compiled("fsdp", activation_checkpointing=True,
                                           micro_batch_size=1, grad_accum_steps=2),
         optimizer="adamw"),
]
if FULL:
    CASES += [case("fsdp1-blocks", compiled("fsdp", fsdp={"version": 1}), optimizer="adamw"),
              case("zero2-blocks", compiled("deepspeed", shard="grad_op"), optimizer="adamw"),
              # DeepSpeedEngine.compile(): the whole model, ZeRO-3's hooks between the graphs
              case("zero3-model", compiled("deepspeed", scope="model", shard="full"),
                   optimizer="adamw")]


def shared_jobs(tmp):
    """The compiled cases in the suite's shared launches (shared.py); dynamo's counters and caches
    are per process, and the watch counts from where the engine started (model/compile.py)."""
    return parity_jobs(tmp, CASES, key="compile")


@needs_deepspeed
@pytest.mark.timeout(900)
def test_compiled_runs_match_eager_and_resume_exactly(shared):
    # one launch per phase for the cases: a block's graph compiled for one serves the next
    check(parity_results(*shared[__name__], key="compile"), CASES)
