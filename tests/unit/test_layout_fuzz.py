"""A layout fuzz (hypothesis): specs drawn over every registered backend variant x shard x dp/tp/cp x
world up to 1024 x micro-batch x accumulation x precision x offload, with hostile numbers mixed in
(0, -1, 10**30, 1.5, inf, nan, strings), go through `polyshard validate`, then `polyshard dryrun` (one
process plays one rank of the world over torch's fake process group: its real mesh, shards and one
step). Each either builds and steps, or exits 2 naming a field; never a traceback, never a crash
inside a step. `make test` runs 300 validations and 60 dry runs; `make test-full` (POLYSHARD_FUZZ=full)
10,000 and 300. The counts that ran are recorded for docs/reliability.md."""

import contextlib
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability import record

from parallel import registry
from parallel.cli.main import main

FULL = os.environ.get("POLYSHARD_FUZZ") == "full"
VALIDATIONS, DRYRUNS = (10_000, 300) if FULL else (300, 60)
VARIANTS = sorted((d.name, name, over) for d in registry.descriptors()
                  for name, over in d.variants.items())
HOSTILE = st.sampled_from([0, -1, 10**30, 2**63, 1.5, "8", None, float("inf"), float("nan"), []])
COUNT = {"validated": 0, "refused": 0, "dry_runs": 0, "dry_refused": 0}
REASONS: list[str] = []


def _or_hostile(good):
    return st.one_of(good, good, good, good, HOSTILE)  # about one value in five is hostile


DRYRUN_VARIANTS = [v for v in VARIANTS if registry.get(v[0]).bench.dryrun is not None]


@st.composite
def layouts(draw, hostile: bool = True):
    """(spec dict, world): a registered variant's overrides under a drawn layout; with `hostile`,
    one example in three carries hostile numbers (in about one field in five)."""
    from parallel.tools.cells import merged

    dry = hostile is None  # mostly what the dry-run backends implement: most examples build
    variants = DRYRUN_VARIANTS if dry else VARIANTS
    hostile = bool(hostile) and draw(st.integers(0, 2)) == 0

    def pick(good):
        return draw(_or_hostile(good) if hostile else good)

    _, _, over = draw(st.sampled_from(variants))
    world = draw(st.sampled_from([1, 2, 4, 8, 16, 64, 256, 1024]))
    per_node = pick(st.sampled_from([n for n in (1, 2, 4, 8) if n <= world]))
    topology = {"procs_per_node": per_node, "tp": pick(st.sampled_from([1, 1, 2, 4, 8])),
                "cp": pick(st.sampled_from([1, 1, 1, 2]))}
    if isinstance(per_node, int) and not isinstance(per_node, bool) and per_node > 0:
        topology["nodes"] = max(1, world // per_node)
    spec = {"topology": topology,
            "shard": pick(st.sampled_from(["full", "grad_op", "none", "hybrid"] + (
                [] if dry else ["optimizer", "hybrid_grad_op"]))),
            "micro_batch_size": pick(st.integers(1, 4)),
            "grad_accum_steps": pick(st.integers(1, 3)),
            "precision": pick(st.sampled_from(["fp32", "bf16", "fp16"])),
            "offload": pick(st.sampled_from(["none", "params"] + ([] if dry else ["optimizer"]))),
            "grad_clip": pick(st.sampled_from([None, 1.0, 0.5]))}
    if draw(st.booleans()):
        spec["activation_checkpointing"] = True
    return merged(spec, over), world


def _cli(capsys, *argv) -> int:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exited:
        code = exited.code
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out, out.err[-3000:]
    assert code in (0, 2), (code, out.err[-3000:])
    if code == 2:  # names a field (a dotted path) or the flag it came from
        assert any(c in out.err for c in (":", "--")), out.err
        REASONS.append(out.err.strip().splitlines()[-1][:160])
    return code


@contextlib.contextmanager
def fake_world_undone():
    """A dry run makes this process rank r of a fake world (environment and process group): both
    undone afterwards, so the next example, and the next test, start clean."""
    import torch.distributed as dist

    saved = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # torch's DeviceMesh caches (submeshes, flattened dims) are keyed by layout, not by process
        # group: a later world of the same layout would be handed the destroyed groups (measured:
        # "Could not resolve the process group registered under the name 1027")
        from torch.distributed.device_mesh import _mesh_resources

        _mesh_resources.__init__()
        os.environ.clear()
        os.environ.update(saved)


@settings(max_examples=VALIDATIONS, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(layouts())
def test_every_drawn_layout_validates_or_names_its_field(tmp_path, capsys, drawn):
    data, _ = drawn
    file = tmp_path / "spec.json"
    file.write_text(json.dumps(data, allow_nan=True))
    code = _cli(capsys, "validate", file)
    COUNT["validated" if code == 0 else "refused"] += 1


@settings(max_examples=DRYRUNS, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(layouts(hostile=None))  # backends that dry-run (their descriptor's bench.dryrun)
def test_every_valid_layout_builds_one_rank_and_steps(tmp_path, capsys, drawn):
    data, world = drawn
    file = tmp_path / "spec.json"
    file.write_text(json.dumps(data))
    with fake_world_undone():
        code = _cli(capsys, "dryrun", file, "--model", "toy:tiny", "--world", world,
                    "--rank", min(1, world - 1), "--seq", 8)
    COUNT["dry_runs" if code == 0 else "dry_refused"] += 1


def test_the_fuzz_ran_and_built_some():
    """Run after the two above (file order): both kinds of outcome were seen, so neither the
    generator nor the checks degenerated into one branch."""
    if COUNT["validated"] + COUNT["refused"] == 0:
        pytest.skip("the fuzz tests did not run in this session")
    record("layout_fuzz", {**COUNT, "some_reasons": sorted(set(REASONS))[:12]})
    assert COUNT["validated"] > 0 and COUNT["refused"] > 0, COUNT
    assert COUNT["dry_runs"] > 0, COUNT
