"""ParallelDims owns every dimension: data-parallel facts (size, rank, the batch rule, DeepSpeed's
train_batch_size, FSDP's mesh) come from it, never from the world size, so tp > 1 changes them."""

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from parallel.spec.dims import ParallelDims
from parallel.spec.io import SpecError, load_spec

ROOT = Path(__file__).resolve().parents[2]


def fake(world, tp=1, shard="full", group=None, per_node=None):
    topo = SimpleNamespace(tp=tp, cp=1, pp=1, ep=1, shard_group_size=group,
                           procs_per_node=per_node or world)
    return SimpleNamespace(world_size=world, shard=shard, topology=topo)


@pytest.mark.parametrize("world,tp,shard,group,want", [
    (8, 1, "full", None, (1, 8, 1)), (8, 2, "full", None, (1, 4, 2)),
    (8, 2, "none", None, (4, 1, 2)), (16, 2, "hybrid", 4, (2, 4, 2)),
    (1024, 8, "hybrid", 8, (16, 8, 8)),
])
def test_layout(world, tp, shard, group, want):
    dims = ParallelDims.from_spec(fake(world, tp, shard, group))
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == want
    assert dims.world_size == world and dims.dp_size == world // tp
    # tp fastest, as the mesh is laid out: a tp group is consecutive ranks sharing one batch slice
    assert [dims.dp_rank(r) for r in range(2 * tp)] == [0] * tp + [1] * tp


def test_spec_data_parallel_facts_come_from_dims():
    spec = load_spec({"backend": "deepspeed", "micro_batch_size": 2, "grad_accum_steps": 3,
                      "topology": {"procs_per_node": 4}})
    assert spec.dims.dp_size == spec.shard_group_size == 4
    from backends.deepspeed.config.translate import translate

    assert translate(spec)["config"]["train_batch_size"] == 2 * 3 * 4


def test_no_batch_arithmetic_multiplies_by_the_world_size():
    """A product of the batch and the world size means the data-parallel size (tp ranks share a
    batch): it must ask spec.dims / engine.dp_size."""
    bad = []
    for path in [*ROOT.glob("parallel/**/*.py"), *ROOT.glob("backends/**/*.py")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(grad_accum_steps|samples_per_step|rows)\s*\*.*world_size", line):
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_mesh_names_every_dimension():
    """One gloo rank: the engine's mesh is (dp_replicate, dp_shard, tp), size-1 dims included."""
    code = ("import os, torch.distributed as dist\n"
            "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29591')\n"
            "dist.init_process_group('gloo', rank=0, world_size=1)\n"
            "from parallel.spec.dims import ParallelDims\n"
            "m = ParallelDims(1, 1, 1).device_mesh('cpu')\n"
            "print(m.mesh_dim_names, m['dp_replicate', 'dp_shard'].ndim, m['tp'].size())\n"
            "dist.destroy_process_group()\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1].split() == ["('dp_replicate',", "'dp_shard',", "'tp')", "2", "1"]


def test_hybrid_default_group_is_one_hosts_data_parallel_ranks():
    """procs_per_node 8 at tp 2 holds 4 data-parallel ranks: the default shard group."""
    dims = ParallelDims.from_spec(fake(16, 2, "hybrid", None, per_node=8))
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (2, 4, 2)


def _tp_problems(data):
    with pytest.raises(SpecError) as info:
        load_spec(data)
    return dict(info.value.problems)


@pytest.mark.parametrize("backend,extra,field,words", [
    ("fsdp", {"fsdp": {"version": 1}}, "topology.tp", ["fsdp.version: 1", "fsdp.version: 2"]),
    ("deepspeed", {"shard": "grad_op", "deepspeed": {"deepcompile": True, "native": {}},
                   "compile": {"enabled": True}}, "deepspeed.deepcompile", ["topology.tp"]),
    ("xla_fsdp", {}, "topology.tp", ["xla.fsdp_version: 1", "xla.fsdp_version: 2"]),
])
def test_backends_that_cannot_split_refuse_tp_naming_why(backend, extra, field, words):
    got = _tp_problems({"backend": backend, "topology": {"procs_per_node": 4, "tp": 2}, **extra})
    assert all(w in got[field] for w in words), got


def test_tp_rules():
    assert "does not divide the world size 6" in _tp_problems(
        {"backend": "fsdp", "topology": {"procs_per_node": 6, "tp": 4}})["topology.tp"]
    assert "tp is 1" in _tp_problems(
        {"backend": "fsdp", "topology": {"tp_plan": {"lm_head": "colwise"}}})["topology.tp_plan"]
    assert "data-parallel size 4" in _tp_problems(
        {"backend": "fsdp", "shard": "hybrid", "topology": {"procs_per_node": 8, "tp": 2,
                                                            "shard_group_size": 3}}
    )["topology.shard_group_size"]
    with pytest.raises(SpecError):  # a style torch has no ParallelStyle for
        load_spec({"backend": "fsdp", "topology": {"procs_per_node": 2, "tp": 2,
                                                   "tp_plan": {"lm_head": "sequence"}}})
    spec = load_spec({"backend": "fsdp", "topology": {"procs_per_node": 8, "tp": 2}})
    assert spec.dims.dp_size == 4 and spec.shard_group_size == 4


def test_the_plan_is_checked_against_the_model_before_anything_is_split():
    """backends/fsdp/parallelize.py's resolve_plan on a real tiny Llama: the model's own plan (the head's
    from its class), and errors naming the field, the layer, the size and the rule."""
    from parallel.engine.model.tp_plan import resolve_plan
    from parallel.toy import build_llama, llama_config

    model = build_llama(llama_config("tiny"))  # 4 heads, 2 KV heads, hidden 32, MLP 64, vocab 256
    plan = resolve_plan(model, 2, None)
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise" and plan["lm_head"] == "colwise_rep"
    with pytest.raises(SpecError) as info:
        resolve_plan(model, 4, None)
    assert "num_key_value_heads 2" in dict(info.value.problems)["topology.tp"]
    with pytest.raises(SpecError) as info:
        resolve_plan(model, 2, {"model.layers.*.mlp.up": "colwise"})
    assert "matches no Linear layer" in dict(info.value.problems)["topology.tp_plan"]
    odd = build_llama(llama_config("tiny", intermediate_size=66, num_attention_heads=2,
                                   num_key_value_heads=2))
    with pytest.raises(SpecError) as info:
        resolve_plan(odd, 4, {"model.layers.*.mlp.up_proj": "colwise"})
    text = info.value.problems[-1][1]
    assert "up_proj's out_features 66" in text and "tp 4" in text, text
    with pytest.raises(SpecError) as info:
        resolve_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2, None)
    assert "has no tp plan" in dict(info.value.problems)["topology.tp_plan"]


def test_spmd_tp_is_the_mesh_model_axis_not_processes():
    """XLA v2 runs one process per host: TP is its mesh's `model` axis, so the process layout has
    no TP (the batch, the loader and the loss weighting see one data-parallel process) and a
    written mesh must put tp on that axis."""
    spec = load_spec({"backend": "xla_fsdp", "xla": {"fsdp_version": 2}, "topology": {"tp": 2}})
    assert spec.process_tp == 1 and spec.dims.tp == 1 and spec.dims.dp_size == 1
    assert "[devices / 2, 2]" in _tp_problems(
        {"backend": "xla_fsdp", "xla": {"fsdp_version": 2, "mesh_shape": [2, 1]},
         "topology": {"tp": 2}})["xla.mesh_shape"]


def test_a_head_tied_to_its_embedding_stays_whole_and_foreign_styles_are_named():
    """One weight cannot be split for the head and whole for the embedding: FSDP2's
    parallelize_module broke the tie (1.1e-2 off one process from step 1), DeepSpeed kept it whole.
    The model's own plan leaves it out (said), a plan of yours is refused."""
    from parallel.engine.model.tp_plan import resolve_plan
    from parallel.toy import build_llama, llama_config

    tied = build_llama(llama_config("tiny", tie_word_embeddings=True))
    said = []
    plan = resolve_plan(tied, 2, None, said.append)
    assert "lm_head" not in plan and "model.layers.*.mlp.down_proj" in plan
    assert "lm_head.weight stays whole" in said[0] and "model.embed_tokens.weight" in said[0]
    with pytest.raises(SpecError) as info:
        resolve_plan(tied, 2, {"lm_head": "colwise_rep"})
    assert "model.embed_tokens.weight" in dict(info.value.problems)["topology.tp_plan"]
    assert "lm_head" in resolve_plan(build_llama(llama_config("tiny")), 2, None)  # untied: split
    odd = build_llama(llama_config("tiny"))
    odd.config.base_model_tp_plan = {"layers.*.mlp.up_proj": "local_colwise"}
    with pytest.raises(SpecError) as info:
        resolve_plan(odd, 2, None)
    assert "local_colwise" in dict(info.value.problems)["topology.tp"]


def test_a_dimension_no_backend_implements_is_refused_naming_why():
    """ep: FSDP2 runs it; a backend without it names itself and the fix."""
    from parallel import registry
    from parallel.spec.errors import SpecError

    lacking = [d.name for d in registry.descriptors() if "ep" not in d.dimensions]
    assert "xla_fsdp" in lacking and "fsdp" not in lacking, lacking
    for name in lacking:
        with pytest.raises(SpecError) as err:
            load_spec({"backend": name, "topology": {"procs_per_node": 4, "ep": 2}})
        message = dict(err.value.problems)["topology.ep"]
        assert f"backend {name!r} does not implement" in message and "use ep: 1" in message


def test_cp_is_refused_where_a_backend_lacks_it_naming_the_field():
    """XLA (both versions) at validation by its descriptor; FSDP1 by its translate (which
    `polyshard validate` runs): only fully_shard's mesh spans data and context parallel ranks."""
    from parallel import registry
    from parallel.spec.errors import SpecError

    lacking = [d.name for d in registry.descriptors() if "cp" not in d.dimensions]
    assert not {"fsdp", "deepspeed", "xla_fsdp"} & set(lacking), lacking
    for name in lacking:
        with pytest.raises(SpecError) as err:
            load_spec({"backend": name, "topology": {"procs_per_node": 2, "cp": 2}})
        assert f"backend {name!r} does not implement" in dict(err.value.problems)["topology.cp"]
    with pytest.raises(SpecError) as err:
        load_spec({"fsdp": {"version": 1}, "topology": {"procs_per_node": 2, "cp": 2}})
    assert "use fsdp.version: 2" in dict(err.value.problems)["topology.cp"]
    with pytest.raises(SpecError) as err:
        load_spec({"backend": "xla_fsdp", "xla": {"fsdp_version": 1},
                   "topology": {"procs_per_node": 2, "cp": 2}})
    assert "use xla.fsdp_version: 2" in dict(err.value.problems)["topology.cp"]
    # SPMD: one process; its mesh holds cp (the process layout has none)
    spmd = load_spec({"backend": "xla_fsdp", "xla": {"fsdp_version": 2},
                      "topology": {"procs_per_node": 1, "cp": 2}})
    assert spmd.dims.cp == 1 and spmd.topology.cp == 2


def test_every_dimension_has_its_slot_in_the_layout():
    dims = ParallelDims(1, 2, tp=2, cp=2)
    assert dims.world_size == 8 and dims.dp_size == 2 and dims.dp_cp == 4
    # a cp group's ranks keep consecutive slices of each row; tp is innermost
    assert [dims.cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # (pp, dp_replicate, dp_shard, cp, tp) row-major: a cp x tp block shares one batch slice
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert dims.mesh_dims == ("dp_replicate", "dp_shard", "cp", "tp")
    assert ParallelDims(2, 2).mesh_dims == ("dp_replicate", "dp_shard", "tp")  # size-1: no cp, pp
    assert ParallelDims(1, 4, pp=2).world_size == 8


def test_ep_borrows_from_dp_shard_x_cp_and_composes_where_fsdp1_cannot():
    from parallel.spec.errors import SpecError

    spec = load_spec({"topology": {"procs_per_node": 8, "ep": 4, "cp": 2}})
    assert (spec.dims.dp_shard, spec.dims.cp, spec.dims.ep, spec.dims.dp_mod_ep) == (4, 2, 4, 2)
    with pytest.raises(SpecError) as err:
        load_spec({"topology": {"procs_per_node": 4, "ep": 3}})
    assert "must divide the ranks it borrows from, dp_shard x cp = 4" in \
        dict(err.value.problems)["topology.ep"]
    with pytest.raises(SpecError) as err:
        load_spec({"fsdp": {"version": 1}, "topology": {"procs_per_node": 4, "ep": 2}})
    assert "use fsdp.version: 2" in dict(err.value.problems)["topology.ep"]
    # each tp rank's and each pipeline rank's data-parallel ranks make its ep groups
    for dim in ("tp", "pp"):
        dims = load_spec({"topology": {"procs_per_node": 8, "ep": 2, dim: 2},
                          "micro_batch_size": 2}).dims
        assert (dims.dp_shard, dims.ep, dims.dp_mod_ep, getattr(dims, dim)) == (4, 2, 2, 2), dim
    for extra in ({"compile": {"enabled": True}},  # the dispatch's host read: a graph break
                  {"fsdp": {"cpu_ram_efficient_loading": True}}):  # each takes its own experts
        load_spec({"topology": {"procs_per_node": 4, "ep": 2}, **extra})
    assert load_spec({"topology": {"procs_per_node": 4, "ep": 2}}).dims.dp_mod_ep == 2


def test_an_ep_refusal_says_why_briefly_and_names_replicas_as_what_ep_cannot_borrow():
    """#80: DeepSpeed's ep refusal was ~900 characters, and it came with a divisibility error that
    named dp_shard x cp = 1 at 2 ranks (DDP's replicas) as if ep could run there."""
    for backend in ("deepspeed", "xla_fsdp"):
        with pytest.raises(SpecError) as err:
            load_spec({"backend": backend, "topology": {"procs_per_node": 2, "ep": 2}})
        (path, message), = err.value.problems
        assert path == "topology.ep" and len(message) < 400, (len(message), message)
    with pytest.raises(SpecError) as err:
        load_spec({"shard": "none", "topology": {"procs_per_node": 2, "ep": 2}})
    assert "dp_replicate 2: replicas, which experts are not split over" in str(err.value)
