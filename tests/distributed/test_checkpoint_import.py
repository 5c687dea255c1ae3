"""Native checkpoints in, Hugging Face weights out, corruption caught.

Plain loops with no polyshard in them (tests/distributed/native_worker.py) write a torch DCP directory
(FSDP2), the same FSDP2 run through Accelerate's own FSDP writers (a save_state / HF Trainer
checkpoint directory: model and optimizer DCPs apart, Trainer's step), a DeepSpeed ZeRO-2
checkpoint and XLA FSDP v1 shard files after 3 AdamW steps (and DeepSpeed's
`ds_to_universal` turns the ZeRO-2 one into a universal checkpoint; the XLA run, with
flatten_parameters and each block wrapped, is cut as its 2 ranks would have saved it);
`polyshard ckpt import` converts each, and FSDP1 and ZeRO-3 (2 ranks) resume from them: steps 4-5
must equal the uninterrupted single-process run, so Adam moments and step counts came along; an imported run
exported with `ckpt export --to deepspeed-universal` resumes in plain DeepSpeed. The DeepSpeed import is
exported with `polyshard ckpt export --to hf`; transformers' from_pretrained loads it and gives step 4's
loss. A truncated and a byte-flipped copy are refused by `ckpt verify` and by `load`, naming the file."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from harness import ROOT, torchrun, needs_both

pytestmark = pytest.mark.distributed
BUDGET_S = 220  # seconds in make test (tests/conftest.py)

DIST = ROOT / "tests" / "distributed"
TWO = {"topology": {"procs_per_node": 2}, "micro_batch_size": 2}
TARGETS = {"fsdp1": {"backend": "fsdp", "fsdp": {"version": 1}, **TWO},
           "zero3": {"backend": "deepspeed", "shard": "full", **TWO}}
# kind -> folder; xla_flat: flatten_parameters, nested, cut as 2 ranks save it (reshard_in_place)
NATIVE = {"dcp": "fsdp2_dcp", "deepspeed": "deepspeed_zero2", "xla": "xla_flat",
          "deepspeed-universal": "deepspeed_universal",
          # Accelerate's / HF Trainer's FSDP2 checkpoint directory, imported whole (kind dcp)
          "accelerate": "accelerate_fsdp2"}
FROZEN = ("deepspeed_zero2_frozen", "deepspeed_zero3_frozen")  # embedding, block 0's attention


def to_universal(native) -> None:
    """DeepSpeed's own converter, as its users run it; a plain DeepSpeed checkpoint lacks
    universal_checkpoint_info (DeepSpeed#5430), which --inject_missing_state supplies."""
    tag = (native / "deepspeed_zero2" / "latest").read_text().strip()
    out = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                          "--input_folder", str(native / "deepspeed_zero2" / tag), "--output_folder",
                          str(native / "deepspeed_universal" / f"{tag}_universal"),
                          "--inject_missing_state"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


def reshard_in_place(folder, world: int) -> None:
    """XLA FSDP v1 files saved at 1 rank, replaced by the files XLA FSDP writes at `world` ranks
    (tests/xla_shards.py; this host's PJRT CPU client runs XLA FSDP v1 at world size 1 only): the
    import streams them one rank's file at a time."""
    from xla_shards import reshard

    (one,) = folder.iterdir()
    saved = torch.load(one, weights_only=False)
    one.unlink()
    for r, part in enumerate(reshard([saved], world)):
        torch.save(part, folder / f"ckpt_rank-{r:08d}-of-{world:08d}.pth")


def polyshard(*args):
    """The CLI's main() in this process (its exit code, what it printed): the conversions start no
    processes, and a process of their own cost 6-8 s of imports each, 9 of them here (2026-11-28);
    the command line itself: tests/unit/test_cli.py."""
    import contextlib
    import io
    import types

    import torch.distributed as dist

    from parallel.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    assert not dist.is_initialized(), f"polyshard {args[:2]} left a process group behind"
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("import")
    native, root = tmp / "native", tmp / "ckpt"
    torchrun(2, [str(DIST / "native_worker.py"), "--which", "fsdp2_dcp,accelerate_fsdp2,"
                 "deepspeed_zero2," + ",".join(FROZEN), "--root", str(native)], timeout=300)
    torchrun(1, [str(DIST / "native_worker.py"), "--which", "xla_flat", "--root", str(native)],
             timeout=300, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "USE_TORCH_XLA": "1"})
    reshard_in_place(native / "xla_flat", 2)
    to_universal(native)
    for kind, folder in NATIVE.items():
        # DeepSpeed records its steps, HF Trainer's trainer_state.json too
        step = [] if kind.startswith(("deepspeed", "accelerate")) else ["--step", 3]
        out = polyshard("ckpt", "import", "dcp" if kind == "accelerate" else kind, native / folder,
                        root / f"native_{kind}-adamw", *step)
        assert out.returncode == 0, out.stderr[-3000:]
    # Accelerate's optimizer folder alone: refused, naming the directory to import (it made a
    # checkpoint of 0 tensors and exited 0)
    out = polyshard("ckpt", "import", "dcp", native / "accelerate_fsdp2" / "optimizer_0",
                    tmp / "optimizer-only")
    assert out.returncode == 2 and "holds no model weights" in out.stderr, out.stderr
    assert not (tmp / "optimizer-only").exists()
    # its model folder alone: weights only, loaded with engine.load(path, weights_only=True); a full
    # checkpoint loads weights-only as well (transfer_worker's "weights_" sources)
    out = polyshard("ckpt", "import", "dcp", native / "accelerate_fsdp2" / "pytorch_model_fsdp_0",
                    root / "weights_accelerate-adamw", "--step", 3)
    assert out.returncode == 0, out.stderr[-3000:]
    shutil.copytree(root / "native_dcp-adamw", root / "weights_full-adamw")
    good = root / "native_deepspeed-adamw"
    for name in ("truncated", "flipped"):  # beside the good ones: one launch loads them all
        shutil.copytree(good, root / f"{name}-adamw")
    shard = next((root / "truncated-adamw" / "state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])
    trainer = root / "flipped-adamw" / "trainer.pt"
    data = bytearray(trainer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    trainer.write_bytes(bytes(data))
    (tmp / "targets.json").write_text(json.dumps(TARGETS))
    torchrun(2, [str(DIST / "transfer_worker.py"), "--phase", "load", "--backends",
                 str(tmp / "targets.json"), "--names", "fsdp1,zero3", "--root", str(root),
                 "--out", str(tmp / "load.json")], timeout=400)
    return tmp, json.loads((tmp / "load.json").read_text())


@needs_both
@pytest.mark.timeout(900)
def test_native_checkpoints_resume_with_optimizer_state(imported):
    _, results = imported
    ref = results["reference-adamw"]["loss"]
    for kind in NATIVE:
        for target in TARGETS:
            res = results[f"native_{kind}->{target}-adamw"]
            assert "error" not in res, res["error"][-3000:]
            assert res["start"] == 3
            diff = max(abs(a - b) for a, b in zip(res["loss"], ref[3:]))
            assert diff <= 1e-5, f"{kind} -> {target}: {res['loss']} vs {ref[3:]}"


@needs_both
@pytest.mark.timeout(900)
def test_weights_only_load_keeps_a_fresh_optimizer(imported):
    """engine.load(path, weights_only=True) on FSDP1 and ZeRO-3: Accelerate's model folder imported
    alone (no optimizer state: a plain load is refused naming weights_only) and a full checkpoint
    both continue as one process over the step-3 weights with a fresh AdamW, from step 0."""
    _, results = imported
    ref = results["reference-weights-adamw"]["loss"]
    assert max(abs(a - b) for a, b in zip(ref, results["reference-adamw"]["loss"][3:])) > 1e-4, (
        "a fresh optimizer must train otherwise than the resumed one, or this test shows nothing")
    for source in ("weights_accelerate", "weights_full"):
        for target in TARGETS:
            res = results[f"{source}->{target}-adamw"]
            assert "error" not in res, res["error"][-3000:]
            assert res["start"] == 0
            diff = max(abs(a - b) for a, b in zip(res["loss"], ref))
            assert len(res["loss"]) == 2 and diff <= 1e-5, (source, target, res["loss"], ref)
    refused = results["weights_accelerate->fsdp1-adamw"]["refused"]
    assert refused and "weights_only=True" in refused, refused


@needs_both
@pytest.mark.timeout(900)
def test_hf_export_loads_in_transformers_with_the_same_loss(imported):
    from parity_worker import global_batches
    from transformers import AutoModelForCausalLM

    from parallel.toy import llama_config

    tmp, results = imported
    llama_config("tiny").to_json_file(tmp / "config.json")  # an import carries no model config
    out = polyshard("ckpt", "export", "--to", "hf", tmp / "ckpt" / "native_deepspeed-adamw",
                    tmp / "hf", "--config", tmp / "config.json")
    assert out.returncode == 0, out.stderr[-3000:]
    model = AutoModelForCausalLM.from_pretrained(tmp / "hf", torch_dtype=torch.float32)
    ids = global_batches(5, 1, 4)[3]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert abs(loss - results["reference-adamw"]["loss"][3]) <= 1e-5


@needs_both
@pytest.mark.timeout(900)
def test_universal_export_resumes_in_plain_deepspeed(imported):
    """The FSDP2 run's checkpoint (imported from torch DCP) exported to DeepSpeed's universal format:
    plain DeepSpeed ZeRO-2 with load_universal carries on with the uninterrupted run's losses, so
    weights, Adam moments, step counts and hyper-parameters all arrived."""
    tmp, results = imported
    out = polyshard("ckpt", "export", "--to", "deepspeed-universal",
                    tmp / "ckpt" / "native_dcp-adamw", tmp / "exported_universal")
    assert out.returncode == 0, out.stderr[-3000:]
    tag = (tmp / "exported_universal" / "latest_universal").read_text()
    assert (tmp / "exported_universal" / tag / "zero" / "lm_head.weight" / "exp_avg_sq.pt").is_file()
    torchrun(2, [str(DIST / "native_worker.py"), "--which", "deepspeed_universal_resume",
                 "--root", str(tmp)], timeout=300)
    resumed = json.loads((tmp / "universal_losses.json").read_text())
    ref = results["reference-adamw"]["loss"][3:]
    diff = max(abs(a - b) for a, b in zip(resumed["loss"], ref))
    assert len(resumed["loss"]) == 2 and diff <= 1e-5, (resumed, ref)
    assert resumed["global_steps"] == 5
    print(f"universal export -> plain DeepSpeed ZeRO-2: steps 4-5 within {diff:.1e}")


@needs_both
@pytest.mark.timeout(900)
def test_truncated_and_flipped_files_are_refused_by_verify_and_load(imported):
    from reliability import record

    tmp, results = imported
    no_manifest = tmp / "bad-no-manifest"
    shutil.copytree(tmp / "ckpt" / "native_deepspeed-adamw", no_manifest)
    (no_manifest / "manifest.json").unlink()
    out = polyshard("ckpt", "verify", no_manifest)
    assert out.returncode == 1 and "manifest missing" in out.stderr, out.stderr
    rows = [{"fault": "manifest deleted", "backend": "ckpt verify / load",
             "outcome": out.stderr.strip().splitlines()[-1][:120]}]
    for name, file, check in (("truncated", "state/__0_0.distcp", "size"),
                              ("flipped", "trainer.pt", "xxh3_128 mismatch")):
        out = polyshard("ckpt", "verify", tmp / "ckpt" / f"{name}-adamw")
        assert out.returncode == 1 and file.split("/")[-1] in out.stderr and check in out.stderr, (
            out.stderr)
        for target in TARGETS:
            error = results[f"{name}->{target}-adamw"]["error"]
            assert "CheckpointError" in error and file.split("/")[-1] in error and check in error
            rows.append({"fault": f"{name} {file}", "backend": target,
                         "outcome": "load refused before reading anything: " + next(
                             line for line in error.splitlines() if "CheckpointError" in line)[-90:]})
    record("faults-corruption", {"summary": f"{len(rows)} corrupted checkpoints, all refused, "
                                 "naming the file and the failed check", "rows": rows})


def assembled(streamed) -> tuple[dict, dict]:
    """A streamed import's parts put together: (model, optimizer state) whole."""
    import math

    from parallel.checkpoint.state.chunks import FlatRange

    model, state = {}, {}

    def put(into, key, value):
        if not isinstance(value, FlatRange):
            into[key] = value
            return
        whole = into.setdefault(key, torch.full((math.prod(value.shape),), float("nan"),
                                                dtype=value.data.dtype))
        whole[value.start:value.start + value.data.numel()] = value.data.reshape(-1)

    for i in range(streamed.writers):
        part = streamed.part(i)
        for name, value in part["model"].items():
            put(model, name, value)
        for name, entry in part["optim"]["state"].items():
            for key, value in entry.items():
                put(state.setdefault(name, {}), key, value)
    return model, state


@needs_both
@pytest.mark.timeout(300)
@pytest.mark.parametrize("which", FROZEN)
def test_frozen_parameters_come_through_a_zero_import(imported, which):
    """Plain DeepSpeed with the embedding and block 0's attention frozen (outside the optimizer, as a
    LoRA run's base): the streamed import (ZeRO-3: each rank's slice from its own model-states file;
    ZeRO-1/2: whole from rank 0's) and DeepSpeed's zero_to_fp32 merge agree bit for bit, and the
    frozen parameters are the initial weights. Before: the streamed path refused them and the merge
    was asked to leave them out, so the import had 16 of the model's 21 tensors."""
    from native_worker import model_and_batches

    from backends.deepspeed.checkpoint.native_checkpoint import read_deepspeed

    tmp, _ = imported
    streamed, steps, world = read_deepspeed(tmp / "native" / which)
    model, state = assembled(streamed)
    whole = read_deepspeed(tmp / "native" / which, stream=False)[0]
    assert (steps, world) == (3, 2)
    assert sorted(model) == sorted(whole["model"]) and sorted(state) == sorted(whole["optim"]["state"])
    for name, value in whole["model"].items():
        assert torch.equal(model[name].reshape(value.shape), value), name
    for name, entry in whole["optim"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(state[name][key]).reshape(torch.as_tensor(value).shape),
                               torch.as_tensor(value)), (name, key)
    initial = model_and_batches()[0].state_dict()
    frozen = sorted(set(model) - set(state))  # the tiny Llama keeps no persistent buffer
    assert len(frozen) == 5 and "model.embed_tokens.weight" in frozen, frozen
    for name in frozen:
        assert torch.equal(model[name].reshape(initial[name].shape), initial[name]), name


@needs_both
@pytest.mark.timeout(300)
@pytest.mark.parametrize("damage", ["short partition", "empty state"])
@pytest.mark.parametrize("stream", [True, False])
def test_a_zero_checkpoint_whose_partitions_cannot_be_its_parameters_is_refused(
        imported, tmp_path, damage, stream):
    """Rank 1's fp32 partition cut to half its length imported with exit 0 (its parameters filled
    from nothing); an optimizer file with no state was a traceback (#65). Both are refused naming
    the file, streamed or merged, and nothing is written."""
    from backends.deepspeed.checkpoint.native_checkpoint import read_deepspeed
    from parallel.checkpoint.importers import CheckpointImportError

    tmp, _ = imported
    src = tmp_path / "zero2"
    shutil.copytree(tmp / "native" / "deepspeed_zero2", src)
    (optim,) = src.glob("*/zero_pp_rank_1_*optim_states.pt")
    saved = torch.load(optim, weights_only=False)  # the test's own file: trusted
    state = saved["optimizer_state_dict"]
    if damage == "short partition":
        flat = state["single_partition_of_fp32_groups"][0]
        state["single_partition_of_fp32_groups"][0] = flat[:flat.numel() // 2].clone()
    else:
        state["base_optimizer_state"]["state"] = {}
    torch.save(saved, optim)
    with pytest.raises(CheckpointImportError, match=optim.name):
        got = read_deepspeed(src, stream=stream)[0]
        if stream:  # parts are read when written: every part, as the import writes them
            for i in range(got.writers):
                got.part(i)
    out = polyshard("ckpt", "import", "deepspeed", src, tmp_path / "out")
    assert out.returncode == 2 and optim.name in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "out").exists()
