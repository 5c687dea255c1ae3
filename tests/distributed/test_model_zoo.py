"""Models people actually train (zoo.py: GPT-2 with tied embeddings, T5, BERT masked-LM, a plain
nn.Module with tuple batches and its own loss, frozen parameters, two param groups built before
prepare) on FSDP2, FSDP1, ZeRO-1/2/3, XLA v1 (world size 1) and XLA v2 (2 devices): 3 steps match
one process to 1e-5, then each backend's checkpoint resumes on the next backend of a cycle and
steps 4-5 match the uninterrupted single-process run."""

import json

import pytest
from harness import ROOT, torchrun, needs_both

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "distributed" / "zoo_worker.py"
TWO = {"topology": {"procs_per_node": 2}, "micro_batch_size": 2}
BACKENDS = {
    "fsdp2": {"backend": "fsdp", **TWO},
    "fsdp1": {"backend": "fsdp", "fsdp": {"version": 1}, **TWO},
    "zero1": {"backend": "deepspeed", "shard": "optimizer", **TWO},
    "zero2": {"backend": "deepspeed", "shard": "grad_op", **TWO},
    "zero3": {"backend": "deepspeed", "shard": "full", **TWO},
    "xla1": {"backend": "xla_fsdp", "micro_batch_size": 4, "xla": {"fsdp_version": 1}},
    "xla2": {"backend": "xla_fsdp", "micro_batch_size": 2, "xla": {"fsdp_version": 2}},
}
CYCLE = list(BACKENDS)
SOURCE_OF = {b: CYCLE[i - 1] for i, b in enumerate(CYCLE)}  # each loads the previous one's
LAUNCHES = [(["fsdp2", "fsdp1", "zero1", "zero2", "zero3"], {"nproc": 2}),
            (["xla1"], {"xla_devices": 1}), (["xla2"], {"xla_devices": 2})]


def launch(tmp, phase, names, how):
    out = tmp / f"{phase}-{names[0]}.json"
    args = [str(WORKER), "--phase", phase, "--backends", str(tmp / "backends.json"),
            "--names", ",".join(names), "--source-of", str(tmp / "source_of.json"),
            "--root", str(tmp / "ckpt"), "--out", str(out)]
    if "nproc" in how:
        torchrun(how["nproc"], args, timeout=500)
    else:
        env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(how["xla_devices"]),
               "USE_TORCH_XLA": "1"}
        torchrun(1, args, timeout=500, env=env)
    return json.loads(out.read_text())


@needs_both
@pytest.mark.timeout(1500)
def test_model_zoo_matches_one_process_and_moves_between_backends(tmp_path):
    (tmp_path / "backends.json").write_text(json.dumps(BACKENDS))
    (tmp_path / "source_of.json").write_text(json.dumps(SOURCE_OF))
    (tmp_path / "ckpt").mkdir()
    saved, loaded = {}, {}
    for names, how in LAUNCHES:
        saved.update(launch(tmp_path, "save", names, how))
    for names, how in LAUNCHES:
        loaded.update(launch(tmp_path, "load", names, how))
    refused = {k: loaded.pop(k, None) or saved.pop(k) for k in
               ("refusal-xla1-split-groups", "refusal-zero2-other-groups")}
    split, other = refused["refusal-xla1-split-groups"], refused["refusal-zero2-other-groups"]
    assert split["error_type"] == "OptimizerMismatch" and "one flat tensor" in split["message"], split
    assert "flatten_parameters: false" in split["message"], split
    assert other["error_type"] == "PortableStateError", other
    assert "other param groups than in the checkpoint" in other["message"], other
    errors = {k: v["error"] for k, v in {**saved, **loaded}.items() if "error" in v}
    assert not errors, "\n\n".join(f"{k}:\n{v[-2500:]}" for k, v in errors.items())
    worst = {}
    for phase, results, (start, stop) in (("trained", saved, (0, 3)), ("resumed", loaded, (3, 5))):
        for key, res in results.items():
            if key.startswith("reference-"):
                continue
            ref = saved[f"reference-{key.split('-', 1)[1]}"]
            assert res.get("start", 0) == start, (key, res)
            diff = max(abs(a - b) for a, b in zip(res["loss"], ref[start:stop]))
            assert len(res["loss"]) == stop - start and diff <= 1e-5, (
                f"{key} {phase} (from {res.get('source', 'scratch')}): {res['loss']} vs {ref[start:]}")
            worst[f"{key} {phase}"] = diff
    assert len(worst) == 2 * len(BACKENDS) * 6
    print(f"{len(worst)} cells, max |loss - one process| = {max(worst.values()):.2e}")
