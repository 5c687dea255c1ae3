"""Evaluation, generation, unwrap, packed documents and the user's registered state on every case of
the registry, at 2 ranks (XLA: its CPU layout), with real `datasets` / `transformers` objects
(hf_job_worker.py), the loss tiled (sequence.loss_tile) and each case's checkpoint restored by another
backend."""

import dataclasses
import json

import matrix
import pytest
from harness import needs_both
from shared import job as launch_job, read

from parallel import registry
from parallel.tools.cells import merged

pytestmark = pytest.mark.distributed
BUDGET_S = 30  # seconds in make test (tests/conftest.py)


def long_rows(case) -> matrix.Case:
    """The job with sequence.loss_tile (every backend), and activations offloaded where the backend
    has it (its descriptor says): every loss of the job, evaluated, trained or packed, is compared
    with the model's own loss computed whole, so the tiled loss is checked on every variant."""
    offload = registry.get(case.backend).capabilities.check("sequence.offload_activations",
                                                            True) is None
    spec = merged(case.spec, {"sequence": {"loss_tile": 16, "offload_activations": offload}})
    return dataclasses.replace(case, spec=spec)


CASES = [long_rows(c) for c in matrix.cases(world=2, micro_batch_size=2)]


def sources() -> dict:
    """Each case loads the checkpoint the next case wrote."""
    names = [c.name for c in CASES]
    return {n: names[(i + 1) % len(names)] for i, n in enumerate(names)}


def shared_jobs(tmp):
    """Save (phase 1) and load (phase 2, fresh processes), one job per launch group, in the
    suite's shared launches (shared.py)."""
    jobs = []
    for number, phase in ((1, "save"), (2, "load")):
        for i, group in enumerate(matrix.by_launch(CASES)):
            cases = [{"name": c.name, "spec": c.spec, "source": sources()[c.name]} for c in group]
            file = tmp / f"{phase}{i}.json"
            file.write_text(json.dumps(cases))
            jobs.append(launch_job("hf_job_worker", [
                "--cases", file, "--phase", phase, "--root", tmp / "ckpt",
                "--out", tmp / f"{phase}{i}"], group[0].nproc, group[0].env, number))
    return jobs


def records(tmp, run, phase: str) -> dict:
    """{case: [rank 0's record, rank 1's ...]} of one phase."""
    out = {}
    for i, group in enumerate(matrix.by_launch(CASES)):
        for rank in range(group[0].nproc):
            file = tmp / f"{phase}{i}.rank{rank}"
            for name, record in read(file, run, "hf_job_worker").items():
                out.setdefault(name, []).append(record)
    return out


@pytest.fixture(scope="module")
def job(shared):
    tmp, run = shared[__name__]
    return records(tmp, run, "save"), records(tmp, run, "load"), tmp / "ckpt"


def job_root(job):
    return job[2]


@needs_both
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_evaluate_generate_unwrap_and_registered_state(job, name):
    saved, loaded, _ = job
    ranks = saved[name]
    for rank, r in enumerate(ranks):
        assert "error" not in r, f"{name} rank {rank}:\n{r['error']}"
        ref = r["ref_eval"]
        for kind in ("map", "stream"):
            got = r[f"eval_{kind}"]
            # every row once over the ranks, token-weighted: one process's numbers on all 9 rows
            assert abs(got["loss"] - ref["loss"]) <= 1e-5, (name, kind, got, ref)
            assert abs(got["token_accuracy"] - ref["token_accuracy"]) <= 1e-6, (name, kind, got)
        if len(ranks) == 2:  # uneven shares: 5 and 4 rows, 3 and 2 batches, no hang
            assert r["eval_map"]["batches"] == r["eval_stream"]["batches"] == 3 - rank
        # packed documents (pack_to 16): their losses one by one, evaluated and trained (1e-5:
        # reductions over ranks in another order than one process's sums)
        assert abs(r["packed_eval"] - r["packed_eval_ref"]) <= 1e-5, (name, r["packed_eval"],
                                                                    r["packed_eval_ref"])
        assert max(abs(a - b) for a, b in zip(r["packed_losses"], r["packed_ref"])) <= 1e-5, (
            name, r["packed_losses"], r["packed_ref"])
        steps = [f"{abs(a - b):.1e}" for a, b in zip(r["packed_losses"], r["packed_ref"])]
        print(f"{name} rank {rank}: packed eval {abs(r['packed_eval'] - r['packed_eval_ref']):.1e} "
              f"off one by one, steps {steps}")
        if "unwrap_error" in r:
            assert name == "xla1" and "XLA FSDP v1" in r["unwrap_error"]
        else:
            assert r["unwrap_diff"] <= 1e-5, (name, r["unwrap_diff"])
        assert r["greedy_equal"], (name, r["greedy"], r["greedy_ref"])
        # rank 1 stops at its first sampled token and rank 0 samples on; XLA runs every step
        static = r.get("xla_new_compiles") is not None
        assert r["sampled_new"] == (6 if static or rank == 0 else 1), (name, rank, r)
        if static:  # 16 and 24 new tokens: the same compiles, a constant (no graph per token)
            first, second = r["xla_new_compiles"]
            assert first == second <= 2, (name, r["xla_new_compiles"])
    # engine.save_pretrained: from_pretrained loads the trained weights (the engine's eval loss)
    import torch
    from transformers import AutoModelForCausalLM

    if "hf_fault" in ranks[0] and not name.startswith("xla"):  # rank 1's writes fail, disk full:
        # both ranks raise (rank 1 its own error), nothing is renamed into place, nothing left
        faults = [r["hf_fault"] for r in ranks]
        assert "No space left" in faults[1]["error"], (name, faults)
        assert "1 of 2 ranks failed" in faults[0]["error"], (name, faults)
        assert faults[0]["left"] == [], (name, faults)
    # rank 0 alone reloads the weights while the job lives; transformers sees ZeRO-3 only in unwrap
    case = next(c for c in CASES if c.name == name)
    zero3 = case.backend == "deepspeed" and case.spec.get("shard", "full") == "full"
    for rank, r in enumerate(ranks):
        reload = r["alone_reload"]
        unwrapped = None if "unwrap_error" in r else zero3
        assert reload["inside_unwrap"] == unwrapped and not reload["after"], (name, rank, reload)
        if unwrapped is not None and r["world_size"] > 1:  # unwrap().save_pretrained: ours named
            assert "engine.save_pretrained(directory)" in reload["own_save"], (name, reload)
    assert ranks[0]["alone_reload"]["params"] > 0, name
    # and checkpoint.hf_at_end: engine.close() wrote the same weights as run/hf-step-N, alone there
    r = ranks[0]
    batch = torch.tensor(r["hf_batch"])
    run = job_root(job) / f"{name}-run"
    assert sorted(p.name for p in run.iterdir()) == [f"hf-step-{r['hf_step']:08d}"], name
    for out in (job_root(job) / f"{name}-hf", run / f"hf-step-{r['hf_step']:08d}"):
        hf = AutoModelForCausalLM.from_pretrained(out)
        with torch.no_grad():
            loss = float(hf(input_ids=batch, labels=batch).loss)
        assert abs(loss - r["hf_eval"]) <= 1e-5, (name, out, loss, r["hf_eval"])
    source = saved[matrix_source(name)]
    for rank, r in enumerate(loaded[name]):
        assert "error" not in r, f"{name} load rank {rank}:\n{r['error']}"
        assert r["tally"] == source[0]["tally"], (name, r, source[0])
        if len(source) == len(loaded[name]):  # same world size: each rank gets its own back
            assert r["mine"] == source[rank]["mine"], (name, rank, r)
        else:
            assert "per rank, written by" in r["load_error"], (name, r)
            assert r["mine"] == [-1.0, 0], (name, r)  # never half-restored


def matrix_source(name: str) -> str:
    return sources()[name]
