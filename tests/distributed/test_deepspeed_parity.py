"""DeepSpeed ZeRO 0-3, 2 gloo ranks on the CPU accelerator: fp32 losses match a single process to
1e-5 (SGD and AdamW), bf16 within a stated tolerance, offload of optimizer and parameters, and steps
4-5 after save at step 3 and load in fresh processes identical to the uninterrupted run."""

import pytest
from harness import case, check_parity, parity_jobs, parity_results
from matrix import FULL

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed
BUDGET_S = 30  # seconds in make test (tests/conftest.py)

BASE = {"backend": "deepspeed", "topology": {"procs_per_node": 2}, "micro_batch_size": 2}
SHARD_OF_STAGE = {0: "none", 1: "optimizer", 2: "grad_op", 3: "full"}


def spec(stage, **extra):
    return {**BASE, "shard": SHARD_OF_STAGE[stage], **extra}


def stage_cases():
    # ZeRO-1/2/3 with SGD and AdamW also train, save and resume in test_checkpoint_transfer.py's
    # matrix; here ZeRO-0 with SGD and ZeRO-1 with AdamW (ZeRO-2 and -3 with AdamW are the option
    # cases'), make test-full (matrix.FULL) ZeRO-0 with both optimizers and every stage with AdamW.
    return [case(f"zero{s}-{opt}", spec(s), optimizer=opt) for s in range(4)
            for opt in ("sgd", "adamw") if (s == 0 or opt == "adamw") and
            (FULL or (s, opt) in ((0, "sgd"), (1, "adamw")))]


def shared_jobs(tmp):
    """Every case of this module in the suite's shared launches (shared.py)."""
    return parity_jobs(tmp, stage_cases() + option_cases())


@pytest.fixture(scope="module")
def every(shared):
    return parity_results(*shared[__name__])


@pytest.mark.timeout(500)
def test_zero_stages_fp32_match_single_process(every):
    results = {c["name"]: every[c["name"]] for c in stage_cases()}
    worst = {name: check_parity(name, res) for name, res in results.items()}
    print(f"DeepSpeed max |loss - reference|: {worst}")
    for name, res in results.items():  # consolidated fp32 weights give the same loss in plain torch
        train = res["train"]
        assert abs(train["consolidated_loss"] - train["loss"][3]) <= 1e-5, (name, train)


# bf16 against the fp32 reference: about twice what was measured (2026-11-26: ZeRO-0 2.8e-3, ZeRO-1/3
# 3.2e-3); zero.Init's other initial draws: 2.9e-2 measured, held to INIT
MIXED = 7e-3
INIT = 5e-2


def option_cases():
    return [
        case("zero2-accum-clip", spec(2, micro_batch_size=1, grad_accum_steps=2, grad_clip=0.5),
             optimizer="adamw"),
        case("zero3-ac", spec(3, activation_checkpointing=True), optimizer="adamw"),
        case("zero2-offload-optimizer", spec(2, offload="optimizer"), optimizer="adamw"),
        # make test-full: on the CPU accelerator the parameters' offload device is their device
        *([case("zero3-offload-params", spec(3, offload="params"), optimizer="adamw")]
          if FULL else []),
        # make test-full: its op takes 50 s to build, which make test's set-up leaves out (Makefile)
        *([case("zero2-cpu-adam", spec(2, offload="optimizer", deepspeed={"cpu_adam": True}),
                optimizer="adamw")] if FULL else []),
        # zero.Init draws the initial weights in another order (same distribution, other numbers:
        # docs/deepspeed.md), so it is held to the mixed-precision tolerance, resume still exact.
        case("zero3-zero-init", spec(3, deepspeed={"zero_init": True}), optimizer="adamw",
             factory=True, tol=INIT, norm_tol=0.5),
        # ZeRO-0 bf16 (DeepSpeed's BF16_Optimizer) drifts further in grad norm than the ZeRO stages
        # (13% vs <10% by step 5, docs/deepspeed.md): a stated, wider norm tolerance.
        *[case(f"zero{s}-bf16", spec(s, precision="bf16"), optimizer="adamw", tol=MIXED,
               norm_tol=0.2 if s == 0 else 0.1) for s in ((0, 1, 3) if FULL else (3,))],
    ]


@pytest.mark.timeout(500)
def test_options_keep_parity(every):
    cases = option_cases()
    results = every
    for c in cases:
        tol = c.get("tol", 1e-5)
        diff = check_parity(c["name"], results[c["name"]], tol=tol,
                            norm_tol=c.get("norm_tol", 1e-4 if tol <= 1e-5 else 0.1))
        if tol > 1e-5:
            assert diff > 1e-6, f"{c['name']}: identical to fp32; was bf16 applied?"
