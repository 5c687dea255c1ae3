"""Files from a stranger (docs/security.md): crafted pickles that would create a marker file, names that
climb out of their directory, symbolic links, foreign directories, bombs, FIFOs. Each test asserts that
nothing ran (no marker), nothing outside changed, nothing of the user's was deleted, and that the CLI
exits 2 (or 1 where a well-formed checkpoint failed verification) naming the file, without a traceback.
The sha256 tables are recomputed after each tampering, as an attacker would."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from budgets import within

from parallel.checkpoint.format.directory import publish, resolve
from parallel.checkpoint.background.finishing import write_checkpoint
from parallel.checkpoint.format.safe import CheckpointError
from parallel.cli.main import main

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "ckpt-v1"


class Payload:
    """Unpickled fully, this runs `touch marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "PWNED"
    yield path
    assert not path.exists(), "a crafted file ran code"


def rehash(ckpt: Path) -> None:
    """What an attacker does after tampering: the version-1 manifest's table made to match."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (ckpt / name).read_bytes()
        manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


@pytest.fixture
def ckpt(tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, copy)
    return copy


def test_a_crafted_dcp_index_is_refused_by_every_command(ckpt, marker, tmp_path, capsys):
    (ckpt / "state" / ".metadata").write_bytes(__import__("pickle").dumps(Payload(marker)))
    rehash(ckpt)
    for argv in (["ckpt", "inspect", ckpt], ["ckpt", "export", "--to", "hf", ckpt, tmp_path / "hf"],
                 ["ckpt", "export", "--to", "deepspeed-universal", ckpt, tmp_path / "u"],
                 ["ckpt", "import", "dcp", ckpt / "state", tmp_path / "imported"]):
        code, err = cli(capsys, *argv)
        assert code == 2 and ".metadata" in err and "system" in err, (argv, err)


def test_a_crafted_byte_entry_is_refused(marker, tmp_path, capsys):
    """DCP reads non-tensor entries with full pickle: each is checked as data first."""
    src = tmp_path / "dcp"
    dcp.save({"w": torch.ones(2), "groups": Payload(marker)}, checkpoint_id=str(src), no_dist=True)
    code, err = cli(capsys, "ckpt", "import", "dcp", src, tmp_path / "imported", "--step", 1)
    assert code == 2 and "entry groups" in err and "system" in err, err
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("kind", ["deepspeed", "deepspeed-universal", "xla"])
def test_crafted_foreign_checkpoints_are_refused(kind, marker, tmp_path, capsys):
    pytest.importorskip("deepspeed")
    src = tmp_path / "src"
    if kind == "deepspeed":
        (src / "global_step1").mkdir(parents=True)
        (src / "latest").write_text("global_step1")
        torch.save(Payload(marker), src / "global_step1" / "mp_rank_00_model_states.pt")
        torch.save(Payload(marker), src / "global_step1" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    elif kind == "deepspeed-universal":
        (src / "zero").mkdir(parents=True)
        torch.save(Payload(marker), src / "mp_rank_00_model_states.pt")
    else:
        src.mkdir()
        torch.save(Payload(marker), src / "ckpt_rank-00000000-of-00000001.pth")
    code, err = cli(capsys, "ckpt", "import", kind, src, tmp_path / "out", "--step", 1)
    assert code == 2 and "refused" in err and "system" in err, err


def test_latest_and_tag_pointers_stay_inside(tmp_path, capsys):
    pytest.importorskip("deepspeed")
    src = tmp_path / "ds"
    src.mkdir()
    (src / "latest").write_text("../../etc")
    code, err = cli(capsys, "ckpt", "import", "deepspeed", src, tmp_path / "out")
    assert code == 2 and "not a plain name" in err, err
    run = tmp_path / "run"
    run.mkdir()
    for pointer in ("../outside", "/etc", "a/b"):
        (run / "latest").write_text(pointer)
        code, err = cli(capsys, "ckpt", "verify", run)
        assert code == 2 and "latest" in err, (pointer, err)
    (tmp_path / "elsewhere").mkdir()
    (run / "latest").unlink()
    (run / "latest").symlink_to(tmp_path / "elsewhere" / "pointer")
    (tmp_path / "elsewhere" / "pointer").write_text("x")
    code, err = cli(capsys, "ckpt", "verify", run)
    assert code == 2 and "symbolic link" in err, err


def _write(path: Path, names: dict, step=1):
    """A polyshard checkpoint (format 2) holding `names` as parameters with Adam state."""
    def files(sink):
        from parallel.checkpoint.state.portable import save_state

        save_state({"model": {n: torch.ones(2) for n in names},
                    "optim": {"state": {n: {"exp_avg": torch.zeros(2), "step": torch.tensor(1.0)}
                                        for n in names},
                              "param_groups": [{"lr": 0.1, "params": list(names)}]}}, sink,
                   collective=False)
    return write_checkpoint(path, 0, files, {"step": step, "world_size": 1, "backend": "fsdp"})


def test_names_from_a_checkpoint_never_become_paths_outside(tmp_path, capsys):
    ckpt = _write(tmp_path / "ckpt", {"../../../../evil/w": None})
    before = {p for p in tmp_path.rglob("*")}
    code, err = cli(capsys, "ckpt", "export", "--to", "deepspeed-universal", ckpt, tmp_path / "out")
    assert code == 2 and "not a plain name" in err, err
    written = {p for p in tmp_path.rglob("*")} - before
    assert all(tmp_path / "out" in p.parents or p == tmp_path / "out" for p in written), written
    assert not (tmp_path.parent / "evil").exists()


def test_hash_tables_may_not_name_files_outside(tmp_path, capsys):
    ckpt = _write(tmp_path / "ckpt", {"w": None})
    table = ckpt / "hashes" / "rank0.json"
    entries = json.loads(table.read_text())
    entries["../../secret"] = {"size": 1, "sha256": "0" * 64}
    table.write_text(json.dumps(entries))
    code, err = cli(capsys, "ckpt", "verify", ckpt)
    assert code == 2 and "not inside the checkpoint" in err, err
    table.write_text(json.dumps(["not", "a", "table"]))
    assert cli(capsys, "ckpt", "verify", ckpt)[0] == 2


@pytest.mark.parametrize("manifest", [
    {"format_version": 2, "step": "7", "world_size": 1, "writers": 1},
    {"format_version": 2, "step": 7, "world_size": 1, "writers": "1"},
    ["not", "an", "object"],
    {"format_version": 2, "step": 7, "world_size": 1, "writers": 10 ** 12},
])
def test_a_manifest_of_the_wrong_types_is_exit_2(tmp_path, capsys, manifest):
    ckpt = _write(tmp_path / "ckpt", {"w": None})
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    code, err = cli(capsys, "ckpt", "inspect", ckpt)
    assert code == 2 and "manifest.json" in err, err


def test_non_utf8_and_zero_byte_files_are_named(tmp_path, capsys):
    ckpt = _write(tmp_path / "ckpt", {"w": None})
    (ckpt / "manifest.json").write_bytes(b"\xff\xfe{}")
    code, err = cli(capsys, "ckpt", "verify", ckpt)
    assert code == 2 and "not UTF-8" in err, err
    ckpt = _write(tmp_path / "other", {"w": None})
    shard = next((ckpt / "state").glob("*.distcp"))
    shard.write_bytes(b"")
    code, err = cli(capsys, "ckpt", "verify", ckpt)
    assert code == 1 and shard.name in err and "size 0" in err, err  # damaged: verify's exit 1


def test_keep_last_deletes_only_polyshards_step_directories(tmp_path):
    root = tmp_path / "runs"
    webapp, imported, mine = root / "webapp", root / "imported-ckpt", root / "notes"
    for d in (webapp, imported, mine):
        d.mkdir(parents=True)
    (webapp / "manifest.json").write_text('{"name": "my-app", "icons": []}')
    (mine / "manifest.json").write_text("not json {")
    shutil.copytree(FIXTURE, imported, dirs_exist_ok=True)  # a polyshard checkpoint, other name
    for step in (1, 2, 3):
        path = _write(root / f"step-{step:08d}", {"w": None}, step)
        publish(path, keep_last=1, managed=root)
    left = sorted(p.name for p in root.iterdir())
    assert left == ["imported-ckpt", "latest", "notes", "step-00000003", "webapp"], left
    # a save outside the managed directory never prunes anything
    other = _write(tmp_path / "elsewhere" / "step-00000009", {"w": None}, 9)
    publish(other, keep_last=1, managed=root)
    assert (root / "step-00000003").is_dir()


def test_saving_onto_a_directory_that_is_not_a_checkpoint_stops(tmp_path, capsys):
    users = tmp_path / "step-00000001"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    with pytest.raises(CheckpointError, match="not a polyshard checkpoint"):
        _write(users, {"w": None})
    assert (users / "thesis.tex").read_text() == "years of work"
    code, err = cli(capsys, "ckpt", "import", "dcp", tmp_path / "nowhere", users, "--step", 1)
    assert code == 2 and (users / "thesis.tex").is_file()
    link = tmp_path / "linked"
    link.symlink_to(users)
    with pytest.raises(CheckpointError, match="not a polyshard checkpoint"):
        _write(link, {"w": None})


def test_planted_links_are_removed_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    root = tmp_path / "runs"
    root.mkdir()
    (root / f".latest.{os.getpid()}.tmp").symlink_to(victim)  # files.write_atomic's
    (root / ".step-00000001.partial").symlink_to(tmp_path)
    path = _write(root / "step-00000001", {"w": None})
    publish(path, keep_last=None, managed=root)
    assert victim.read_text() == "keep me"
    assert (root / "latest").read_text().strip() == "step-00000001"
    assert not any((tmp_path / d).exists() for d in ("hashes", "state", "manifest.json"))


def test_a_crash_between_the_renames_keeps_one_complete_copy(tmp_path, monkeypatch):
    path = _write(tmp_path / "ck", {"w": None}, step=1)
    real = Path.rename
    calls = []

    def crash_second(self, target):
        calls.append(target)
        if Path(target) == path and self.name.endswith(".partial"):  # old aside, new not in place
            raise KeyboardInterrupt("killed between the renames")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", crash_second)
    with pytest.raises(KeyboardInterrupt):
        _write(path, {"w": None}, step=2)
    monkeypatch.setattr(Path, "rename", real)
    assert not path.exists()
    survivor = resolve(path)  # the complete previous copy
    assert json.loads((survivor / "manifest.json").read_text())["step"] == 1
    again = _write(path, {"w": None}, step=3)  # the next save puts it back first, then replaces
    assert json.loads((again / "manifest.json").read_text())["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def _validate_in_time(capsys, *argv):
    with within(10):  # a bomb runs for minutes or exhausts memory
        return cli(capsys, "validate", *argv)


def test_bombs_and_fifos_are_refused_fast(tmp_path, capsys):
    fifo = tmp_path / "ds.json"
    os.mkfifo(fifo)
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"backend: deepspeed\ndeepspeed:\n  native: {fifo}\n")
    code, err = _validate_in_time(capsys, spec)
    assert code == 2 and "not a regular file" in err, err
    spec.write_text("backend: deepspeed\ndeepspeed:\n  native: /dev/zero\n")
    code, err = _validate_in_time(capsys, spec)
    assert code == 2 and "not a regular file" in err, err
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi"))
    spec.write_text(laughs)
    code, err = _validate_in_time(capsys, spec)
    assert code == 2 and "alias" in err, err
    spec.write_text("[" * 100_000 + "]" * 100_000)
    code, err = _validate_in_time(capsys, spec)
    # ours ("nested more than 64 levels"), or the libyaml of PyPI's PyYAML 6.0.3 wheels for Python
    # 3.11 since 2026, which stops at 1,000 levels itself ("exceeded maximum nesting depth")
    assert code == 2 and "nest" in err, err
    spec.write_text("x" * (17 << 20))
    code, err = _validate_in_time(capsys, spec)
    assert code == 2 and "bytes" in err, err


def test_model_configs_are_local_bounded_and_run_no_code(tmp_path, capsys):
    pytest.importorskip("transformers")
    spec = tmp_path / "spec.yaml"
    spec.write_text("backend: fsdp\n")
    config = tmp_path / "config.json"
    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100}
    config.write_text(json.dumps({**base, "num_hidden_layers": 100_000_000}))
    with within(15):
        code, err = cli(capsys, "plan", spec, "--model", config, "--world", 8)
    assert code == 2 and "num_hidden_layers" in err, err
    config.write_text(json.dumps({**base, "num_hidden_layers": 2,
                                  "auto_map": {"AutoConfig": "evil.Config"}}))
    code, err = cli(capsys, "plan", spec, "--model", config, "--world", 8)
    assert code == 2 and "auto_map" in err, err
    code, err = cli(capsys, "plan", spec, "--model", "meta-llama/Llama-3.1-8B", "--world", 8)
    assert code == 2 and "never downloads" in err, err


def test_names_in_a_checkpoint_are_text_not_markup(ckpt, capsys):
    """rich reads '[...]' as markup: a crafted closing tag raised MarkupError (a traceback), any
    other tag restyled the table. inspect prints the checkpoint's own words as they are."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["backend"] = "evil[/x][bold]"
    manifest["versions"] = {"torch[/y]": "2.9"}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert cli(capsys, "ckpt", "inspect", ckpt)[0] == 0  # MarkupError before the fix


def test_an_import_report_prints_patterns_as_written(tmp_path, capsys):
    """'*.[qkv]_proj' in a DeepSpeed partition_config is a pattern, not a rich style tag."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {
        "autotp_size": 2, "partition_config": {"layer_specs": [
            {"patterns": [r".*\.[qkv]_proj\.weight$"], "partition_type": "column"}]}}}))
    code, err = cli(capsys, "import", "deepspeed", path, "--set", "topology.procs_per_node=2")
    assert code == 0 and "*.[qkv]_proj" in err, err


def test_imports_never_follow_a_link_or_open_a_fifo_inside_the_source(tmp_path, capsys):
    """`ckpt import` (#65): a DCP data file that is a link out of SRC or a FIFO (which hung the
    import), and DeepSpeed's tag directory or a universal zero/<name>/ folder that is a link, are
    refused naming them; nothing outside is read."""
    import torch.distributed.checkpoint as dcp

    outside = tmp_path / "outside"
    dcp.save({"model": {"w": torch.randn(4, 4)}}, checkpoint_id=str(outside), no_dist=True)
    for plant in ("link", "fifo"):
        src = tmp_path / f"dcp-{plant}"
        dcp.save({"model": {"w": torch.randn(4, 4)}}, checkpoint_id=str(src), no_dist=True)
        (data,) = src.glob("*.distcp")
        data.unlink()
        if plant == "link":
            data.symlink_to(next(outside.glob("*.distcp")))
        else:
            os.mkfifo(data)
        code, err = cli(capsys, "ckpt", "import", "dcp", src, tmp_path / f"out-{plant}", "--step", 1)
        assert code == 2 and data.name in err, err
        assert not (tmp_path / f"out-{plant}").exists()
    ds = tmp_path / "ds"
    ds.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (ds / "global_step1").symlink_to(tmp_path / "elsewhere")
    (ds / "latest").write_text("global_step1")
    code, err = cli(capsys, "ckpt", "import", "deepspeed", ds, tmp_path / "out-ds")
    assert code == 2 and "symbolic link" in err and "global_step1" in err, err
