"""Files from a stranger, round two (docs/security.md): what was added since the first round reads,
writes and imports only what it should. A checkpoint's small files through the one reader
(parallel/checkpoint/format/contents.py: listed, inside, no link, bounded, parsed into a schema), `latest`'s
fallback and keep_last, tracker run files, tokenizers and PEFT configs as data, model sizes bounded by
their product, stores on loopback, numbers on the command line and in imported configs. Each case
asserts that nothing ran, nothing outside changed, nothing of the user's was lost, and that the CLI
exits 2 naming the file or flag without a traceback. Hash tables are recomputed after tampering, as
an attacker would."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from budgets import within

from parallel.checkpoint.format.directory import publish, resolve
from parallel.checkpoint.format.safe import UnsafeFileError
from parallel.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out, out.err
    return code, out.err


def relist(ckpt: Path, writer: int = 0, add: tuple = ()) -> None:
    """The attacker's step: writer's hash table made to match the files (and to list `add`)."""
    table = ckpt / "hashes" / f"rank{writer}.json"
    entries = json.loads(table.read_text())
    for name in [*entries, *add]:
        file = ckpt / name
        if file.is_file() and not file.is_symlink():
            data = file.read_bytes()
            entries[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    table.write_text(json.dumps(entries))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint of a tiny Llama with a registered object, and the engine that wrote it."""
    from parallel import create_engine, load_spec
    from parallel.toy import build_llama, llama_config

    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    root = tmp_path_factory.mktemp("saved")
    engine = create_engine(load_spec({"backend": "fsdp", "micro_batch_size": 2}))
    torch.manual_seed(0)
    engine.prepare(build_llama(llama_config("tiny")), (torch.optim.SGD, {"lr": 0.1}))
    engine.register_for_checkpointing(Counter(), "counter")
    engine.save(root / "ckpt")
    yield engine, root / "ckpt"
    engine.close()


@pytest.fixture
def ckpt(saved, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(saved[1], copy)
    return copy


# -- the one reader of a checkpoint's files ----------------------------------------------------------

def _outside(tmp_path: Path) -> Path:
    secret = tmp_path / "secret.pt"
    torch.save({"step": 5, "scheduler": None, "loaders": {}}, secret)
    return secret


@pytest.mark.parametrize("plant", ["trainer-link", "user-link", "user-dir-link", "unlisted-user",
                                   "rng-link", "fifo"])
def test_engine_load_reads_only_listed_plain_files(saved, ckpt, tmp_path, plant):
    engine = saved[0]
    secret = _outside(tmp_path)
    if plant == "trainer-link":
        (ckpt / "trainer.pt").unlink()
        (ckpt / "trainer.pt").symlink_to(secret)
    elif plant == "user-link":
        (ckpt / "user" / "counter.pt").unlink()
        (ckpt / "user" / "counter.pt").symlink_to(secret)
    elif plant == "user-dir-link":
        shutil.rmtree(ckpt / "user")
        (tmp_path / "elsewhere").mkdir()
        shutil.copy(secret, tmp_path / "elsewhere" / "counter.pt")
        (ckpt / "user").symlink_to(tmp_path / "elsewhere")
    elif plant == "unlisted-user":  # a file the writer never listed: refused whatever it holds
        table = ckpt / "hashes" / "rank0.json"
        entries = json.loads(table.read_text())
        del entries["user/counter.pt"]
        table.write_text(json.dumps(entries))
    elif plant == "rng-link":
        (ckpt / "rng" / "rank0.pt").unlink()
        (ckpt / "rng" / "rank0.pt").symlink_to(secret)
    elif plant == "fifo":
        (ckpt / "trainer.pt").unlink()
        os.mkfifo(ckpt / "trainer.pt")
    relist(ckpt)
    with within(10, wall_s=60):  # a FIFO never blocks the read
        with pytest.raises(Exception) as err:
            engine.load(ckpt)
    text = str(err.value)
    assert any(word in text for word in ("symbolic link", "not listed", "not a regular file",
                                         "passes through")), text


@pytest.mark.parametrize("state,field", [
    ([1, 2, 3], "(the whole file)"),
    ({"step": "7", "scheduler": None, "loaders": {}}, "step"),
    ({"step": -1, "scheduler": None, "loaders": {}}, "step"),
    ({"step": 1, "scheduler": None, "loaders": {"loader0": {"epoch": 10**30}}}, "loaders"),
    ({"step": 1, "scheduler": None, "loaders": {"loader0": {"batch_size": "two"}}}, "loaders"),
    ({"step": 1, "scheduler": [1], "loaders": {}}, "scheduler"),
])
def test_a_malformed_trainer_state_names_file_and_field(saved, ckpt, state, field):
    torch.save(state, ckpt / "trainer.pt")
    relist(ckpt)
    with pytest.raises(UnsafeFileError, match="trainer.pt") as err:
        saved[0].load(ckpt)
    assert f"field {field}" in str(err.value), err.value


def test_a_pickle_that_runs_code_is_refused_through_the_reader(saved, ckpt, tmp_path):
    marker = tmp_path / "PWNED"
    torch.save(Payload(marker), ckpt / "user" / "counter.pt")
    relist(ckpt)
    with pytest.raises(UnsafeFileError, match="counter.pt"):
        saved[0].load(ckpt)
    assert not marker.exists()


@pytest.mark.parametrize("spec", [["a list"], {"precision": ["bf16"]}, {"grad_clip": "x"}])
def test_a_manifest_spec_of_the_wrong_shape_is_exit_2(ckpt, tmp_path, capsys, spec):
    manifest = ckpt / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "spec": spec}))
    for argv in (("ckpt", "inspect", ckpt), ("ckpt", "export", "--to", "hf", ckpt, tmp_path / "o")):
        code, err = cli(capsys, *argv)
        assert code == 2 and "manifest.json" in err and "field spec" in err, err


# -- latest's fallback and keep_last ---------------------------------------------------------------

def test_the_old_copy_fallback_never_follows_a_link_out(ckpt, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "latest").write_text("step-00000002\n")
    (run / ".step-00000002.old").symlink_to(ckpt)  # a complete checkpoint, outside the run
    assert resolve(run) == run / "step-00000002"
    code, err = cli(capsys, "ckpt", "verify", run)
    assert code != 0 and "step-00000002" in err and "manifest missing" in err, err


def test_keep_last_ranks_by_the_names_it_wrote(saved, tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    for step in (1, 2, 3):
        shutil.copytree(saved[1], root / f"step-{step:08d}")
        manifest = root / f"step-{step:08d}" / "manifest.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "step": step}))
    planted = root / "step-99999999"
    shutil.copytree(saved[1], planted)
    (planted / "manifest.json").write_text(json.dumps(
        {**json.loads((planted / "manifest.json").read_text()), "step": 10**18}))
    liar = root / "step-00000000"  # an older name whose manifest claims to be the newest
    shutil.copytree(saved[1], liar)
    (liar / "manifest.json").write_text(json.dumps(
        {**json.loads((liar / "manifest.json").read_text()), "step": 10**18}))
    newest = root / "step-00000004"
    shutil.copytree(saved[1], newest)
    (newest / "manifest.json").write_text(json.dumps(
        {**json.loads((newest / "manifest.json").read_text()), "step": 4}))
    publish(newest, keep_last=2, managed=root)
    left = sorted(p.name for p in root.iterdir())
    # the user's two newest stay; neither planted directory counts, or is touched
    assert left == ["latest", "step-00000000", "step-00000003", "step-00000004",
                    "step-99999999"], left


# -- run files -----------------------------------------------------------------------------------

def test_run_files_are_never_written_through_links(tmp_path):
    from parallel.engine.observe.trackers import JsonlSink, keep_id
    from parallel.files import FileError, plain_folder

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / "wandb_run_id").symlink_to(victim)
    keep_id(run, "wandb_run_id", "abc123")  # the link is replaced, its target untouched
    assert victim.read_text() == "keep me" and (run / "wandb_run_id").read_text() == "abc123\n"
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(FileError, match="metrics.jsonl"):
        JsonlSink(run, "p", "r", None)
    with pytest.raises(FileError, match="symbolic link inside a run folder"):
        plain_folder(run, "a run folder")
    os.unlink(run / "metrics.jsonl")
    os.mkfifo(run / "metrics.jsonl")  # would block the job on open
    with pytest.raises(FileError, match="metrics.jsonl"):
        JsonlSink(run, "p", "r", None)
    linked = tmp_path / "linked-run"
    linked.symlink_to(tmp_path)
    with pytest.raises(FileError, match="a symbolic link where a run folder"):
        plain_folder(linked, "a run folder")
    assert victim.read_text() == "keep me"


# -- tokenizers and PEFT configs as data -----------------------------------------------------------

def _tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))
    return path


def _edit_json(file: Path, **changes) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


@pytest.mark.parametrize("attack", ["auto_map", "template-name", "link", "fifo"])
def test_a_tokenizer_is_copied_as_data(ckpt, tmp_path, capsys, attack):
    tok = _tokenizer(tmp_path / "tok")
    marker = tmp_path / "PWNED"
    if attack == "auto_map":
        (tok / "tokenization_evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
        _edit_json(tok / "tokenizer_config.json",
                   auto_map={"AutoTokenizer": ["tokenization_evil.Evil", None]})
    elif attack == "template-name":
        _edit_json(tok / "tokenizer_config.json", chat_template=[
            {"name": "../../../escaped", "template": "{{ messages }}"},
            {"name": "default", "template": "{{ messages }}"}])
    elif attack == "link":
        (tmp_path / "vocab.txt").write_text("x")
        (tok / "vocab.txt").symlink_to(tmp_path / "vocab.txt")
    elif attack == "fifo":
        os.mkfifo(tok / "added_tokens.json")
    out = tmp_path / "out" / "deeper"
    code, err = cli(capsys, "ckpt", "export", "--to", "hf", ckpt, out, "--tokenizer", tok)
    assert code == 2 and str(tok) in err, err
    assert not marker.exists() and not list(tmp_path.rglob("escaped*")), "wrote or ran outside"


def test_a_plain_tokenizer_still_exports(ckpt, tmp_path, capsys):
    tok = _tokenizer(tmp_path / "tok")
    _edit_json(tok / "tokenizer_config.json", chat_template=[
        {"name": "default", "template": "{{ messages }}"},
        {"name": "tool_use", "template": "{{ tools }}"}])
    code, err = cli(capsys, "ckpt", "export", "--to", "hf", ckpt, tmp_path / "out", "--tokenizer",
                    tok)
    assert code == 0, err
    # transformers 4.57 writes named templates to additional_chat_templates/NAME.jinja
    assert (tmp_path / "out" / "additional_chat_templates" / "tool_use.jinja").is_file()


def _peft(ckpt: Path, adapter: dict) -> None:
    (ckpt / "peft_config.json").write_text(json.dumps({"active": "default", "adapters": {
        "default": {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
                    **adapter}}}))
    relist(ckpt, add=("peft_config.json",))


@pytest.mark.parametrize("adapter,field", [
    ({"megatron_config": {"tensor_model_parallel_size": 1}, "megatron_core": "os"},
     "megatron_config"),
    ({"megatron_core": "subprocess"}, "megatron_core"),
    ({"target_modules": "(a+)+$"}, "target_modules"),
    ({"target_modules": "x" * 5000}, "target_modules"),
    ({"rank_pattern": {"(.*a){20}": 4}}, "rank_pattern"),
    ({"auto_mapping": {"base_model_class": "Evil", "parent_library": "os"}}, "auto_mapping"),
    ({"r": 10**12}, "r"),
])
def test_a_peft_config_is_read_as_data(ckpt, tmp_path, capsys, adapter, field):
    _peft(ckpt, adapter)
    with within(10):  # a backtracking pattern is refused, not run
        code, err = cli(capsys, "ckpt", "export", "--to", "peft", ckpt, tmp_path / "out")
    assert code == 2 and "peft_config.json" in err and field in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changes,said", [
    ({"num_hidden_layers": 10**7}, "num_hidden_layers"),
    ({"num_hidden_layers": -2}, "positive integer"),
    ({"hidden_size": 65536, "intermediate_size": 1 << 20, "num_hidden_layers": 1024},
     "parameters"),
    ({"auto_map": {"AutoModelForCausalLM": "evil.Model"}}, "auto_map"),
    ({"architectures": ["os"]}, "architectures"),
])
def test_an_hf_config_in_a_checkpoint_is_bounded(ckpt, tmp_path, capsys, changes, said):
    _edit_json(ckpt / "hf_config.json", **changes)
    relist(ckpt)
    _peft(ckpt, {})
    with within(10):
        code, err = cli(capsys, "ckpt", "export", "--to", "peft", ckpt, tmp_path / "out")
    assert code == 2 and said in err, err


@pytest.mark.parametrize("archs", [["pipeline"], ["os"], "LlamaForCausalLM", {"0": "x"}, [3]])
def test_an_hf_export_whose_architectures_name_no_model_class_writes_no_generation_config(
        ckpt, tmp_path, capsys, archs):
    """`ckpt export --to hf`: architectures naming a function (transformers.pipeline was called
    `.can_generate()` on: a traceback, #65), a module, a bare string or a mapping is no model
    class: the weights export and no generation config is guessed."""
    _edit_json(ckpt / "hf_config.json", architectures=archs)
    relist(ckpt)
    code, err = cli(capsys, "ckpt", "export", "--to", "hf", ckpt, tmp_path / "out")
    assert code == 0, err
    assert not (tmp_path / "out" / "generation_config.json").exists()


# -- sizes, numbers, stores ------------------------------------------------------------------------

@pytest.mark.parametrize("config", [
    {"num_hidden_layers": 1024, "hidden_size": 131072, "intermediate_size": 1 << 20},
    {"num_hidden_layers": -4},
    {"hidden_size": 64.5},
])
def test_model_sizes_are_bounded_by_their_product(tmp_path, capsys, config):
    file = tmp_path / "config.json"
    file.write_text(json.dumps({"model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
                                "intermediate_size": 128, "num_attention_heads": 4, **config}))
    with within(10):
        for argv in (("plan", ROOT / "configs/demo.yaml", "--model", file, "--world", 8),
                     ("dryrun", ROOT / "configs/demo.yaml", "--model", file, "--world", 8)):
            code, err = cli(capsys, *argv)
            assert code == 2 and "--model" in err, err


def test_dryrun_weighs_a_rank_against_the_memory_the_kernel_can_give():
    """The refusal's "available" is MemAvailable (free pages plus reclaimable cache), not MemFree:
    CI, after a suite had read gigabytes of checkpoints, had 3.5 GiB free of 24 and refused the
    8B tp 8 x cp 4 rank (4.1 GiB) that fits."""
    from parallel.spec.errors import SpecError
    from parallel.tools.dryrun import HOST_SHARE, check_fits

    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(fields["MemAvailable"].split()[0]) * 1024
    check_fits(0.9 * HOST_SHARE * available, 1024, 1)
    with pytest.raises(SpecError, match="--world"):
        check_fits(1.1 * HOST_SHARE * available, 1024, 1)


@pytest.mark.parametrize("flag,argv", [
    ("--world", ("plan", "configs/demo.yaml", "--model", "toy:demo", "--world", "0")),
    ("--per-node", ("plan", "configs/demo.yaml", "--model", "toy:demo", "--world", "8",
                    "--per-node", "0")),
    ("--model", ("plan", "configs/demo.yaml", "--model", "inf", "--world", "8")),
    ("--model", ("plan", "configs/demo.yaml", "--model", "-7e9", "--world", "8")),
    ("--model", ("plan", "configs/demo.yaml", "--model", "nan", "--world", "8")),
    ("--budget", ("plan", "configs/demo.yaml", "--model", "7e9", "--world", "8", "--budget", "inf")),
    ("--fragmentation", ("plan", "configs/demo.yaml", "--model", "7e9", "--world", "8",
                         "--fragmentation", "1.5")),
    ("--world", ("dryrun", "configs/demo.yaml", "--model", "toy:tiny", "--world", str(10**12))),
    ("--seq", ("dryrun", "configs/demo.yaml", "--model", "toy:tiny", "--world", "4", "--seq", "0")),
    ("--steps", ("parity", "configs/demo.yaml", "--steps", "-1")),
    ("--warmup", ("bench", "configs/demo.yaml", "--warmup", "1e3")),
    ("--nproc", ("launch", "--nproc", "0", "configs/demo.yaml", "x.py")),
    ("--step", ("ckpt", "import", "dcp", "a", "b", "--step", "-3")),
])
def test_numbers_on_the_command_line_are_bounded(capsys, flag, argv, monkeypatch):
    monkeypatch.chdir(ROOT)
    try:
        code = main(list(argv))
    except SystemExit as exited:  # argparse's own exit 2
        code = exited.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and flag in err, err


@pytest.mark.parametrize("kind,text,said", [
    ("deepspeed", '{"train_micro_batch_size_per_gpu": 1e999}', "a.json"),
    ("deepspeed", '{"zero_optimization": {"stage": 3, "reduce_bucket_size": 1e999}}', "a.json"),
    ("deepspeed", '{"zero_optimization": {"stage": [3]}}', "zero_optimization.stage"),
    ("deepspeed", '{"train_micro_batch_size_per_gpu": [2]}', "train_micro_batch_size_per_gpu"),
    ("deepspeed", '{"gradient_accumulation_steps": 0}', "gradient_accumulation_steps"),
    ("deepspeed", '{"gradient_clipping": "1.0"}', "gradient_clipping"),
    ("accelerate", "distributed_type: FSDP\nnum_processes: .inf\n", "num_processes"),
    ("accelerate", "distributed_type: FSDP\nnum_processes: [2]\n", "num_processes"),
    ("accelerate", "distributed_type: FSDP\nnum_machines: 0\nnum_processes: 2\n", "num_machines"),
    ("accelerate", "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: [2]\n",
     "fsdp_version"),
    ("accelerate", "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
     "  zero_stage: 2\n  gradient_clipping: .nan\n", "gradient_clipping"),
    ("accelerate", "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
     "  zero_stage: 2\n  gradient_accumulation_steps: 0\n", "gradient_accumulation_steps"),
    # round three (#65): lists and mappings where numbers, flags or devices belong (tracebacks)
    *[("deepspeed", json.dumps({"zero_optimization": {"stage": 3, key: bad}}), key)
      for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size",
                  "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
                  "zero_hpz_partition_size") for bad in ([], {})],
    ("deepspeed", '{"zero_optimization": {"stage": 3, "offload_param": {"device": []}}}',
     "zero_optimization.offload_param.device"),
    ("deepspeed", '{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": {}}}}',
     "zero_optimization.offload_optimizer.device"),
    ("deepspeed", '{"zero_optimization": {"reduce_bucket_size": "5e8"}}', "reduce_bucket_size"),
    ("accelerate", "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
     "  zero_stage: []\n", "zero_stage"),
])
def test_imported_configs_with_hostile_numbers_are_exit_2(tmp_path, capsys, kind, text, said):
    file = tmp_path / ("a.json" if kind == "deepspeed" else "a.yaml")
    file.write_text(text)
    code, err = cli(capsys, "import", kind, file)
    assert code == 2 and said in err, err


def test_a_tp_plan_from_a_file_is_bounded(tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"topology": {"procs_per_node": 2, "tp": 2, "tp_plan": {
        f"model.layers.{i}.self_attn.q_proj": "bad" for i in range(100_000)}}}))
    with within(15):  # libyaml: 4 s here; PyYAML's Python parser took 13 s
        code, err = cli(capsys, "validate", spec)
    assert code == 2 and "100,000 problems" in err and len(err) < 10_000, len(err)


def test_an_in_process_store_listens_on_loopback_only():
    """notebook_launch's rank 0 serves init_process_group's env:// store: after
    listen_on_loopback (which its ranks call), that store listens on 127.0.0.1, not on every
    interface (torch's default)."""
    code = """
import os, torch.distributed as dist
from parallel.launch.agent import listen_on_loopback
from parallel.dist import free_port
listen_on_loopback()
port = free_port()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
hexport = f"{port:04X}"
rows = [l.split() for l in open("/proc/net/tcp").read().splitlines()[1:]
        + open("/proc/net/tcp6").read().splitlines()[1:]]
listening = [r[1] for r in rows if r[1].endswith(":" + hexport) and r[3] == "0A"]
print(listening)
assert listening and all(a.startswith("0100007F") for a in listening), listening
dist.destroy_process_group()
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "USE_TORCH_XLA": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_bench_disk_probe_writes_only_a_new_file_of_its_own(tmp_path):
    """bench --save's disk probe: a planted link or FIFO at the name it used (#65) is never opened
    (the 1 GiB write went through the link; the FIFO hung it), and nothing but its own file goes."""
    import os

    from parallel.tools.bench.disk import disk_gbps

    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".polyshard-disk-probe").symlink_to(outside)
    os.mkfifo(tmp_path / "d" / "fifo")
    got = disk_gbps(tmp_path / "d", size=8 << 20)
    assert got["write_gbps"] > 0 and outside.read_bytes() == b"keep"
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [".polyshard-disk-probe", "fifo"]
