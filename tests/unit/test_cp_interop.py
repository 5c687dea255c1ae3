"""topology.cp to and from the tools' files: accelerate's parallelism_config cp_size (FSDP2) and
DeepSpeed's sequence_parallel_size, each checked by the tool's own parser where it has one; what a
tool cannot carry is refused naming the field."""

import functools
import json

import pytest

from backends.deepspeed.files import interop as ds_interop
from parallel.interop.accelerate import from_accelerate
from parallel.interop.export import export
from parallel.spec.io import SpecError, load_spec

from_deepspeed = functools.partial(ds_interop.from_deepspeed, validate=load_spec)


def export_to(fmt, spec):
    return export(spec, fmt)


def test_fsdp2_cp_exports_to_accelerates_mesh_and_back():
    spec = load_spec({"backend": "fsdp", "micro_batch_size": 2,
                      "topology": {"procs_per_node": 8, "tp": 2, "cp": 2}})
    out = export_to("accelerate", spec)
    par = out["parallelism_config"]
    assert par == {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2,
                   "parallelism_config_cp_size": 2}
    from accelerate.parallelism_config import ParallelismConfig

    # accelerate's own mesh: the same world, cp beside tp as ours
    theirs = ParallelismConfig(dp_shard_size=2, tp_size=2, cp_size=2)
    assert theirs.total_size == spec.world_size
    assert list(theirs.dp_shard_cp_dim_names) == ["dp_shard", "cp"]
    back, _ = from_accelerate({**{k: v for k, v in out.items() if k != "__files__"}})
    assert (back["topology"]["cp"], back["topology"]["tp"]) == (2, 2)
    assert load_spec(back).dims == spec.dims


def test_deepspeed_sequence_parallel_size_is_cp_with_deepspeeds_batch_count():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    spec = load_spec({"backend": "deepspeed", "shard": "grad_op", "micro_batch_size": 2,
                      "grad_accum_steps": 3, "topology": {"procs_per_node": 2, "cp": 2}})
    exported = export_to("deepspeed", spec)
    assert exported["sequence_parallel_size"] == 2
    # DeepSpeed counts world / sequence_parallel_size data-parallel ranks (one, here): its own
    # parser (one process: world 1) takes the file's batch as that rank's
    assert exported["train_batch_size"] == 2 * 3 * spec.dims.dp_size == 6
    DeepSpeedConfig(json.loads(json.dumps(exported)))
    back, report = from_deepspeed(exported, given={"topology": {"procs_per_node": 2}})
    assert back["topology"]["cp"] == 2 and back.get("global_batch_size", 6) == 6
    assert load_spec({**back, "topology": {**back["topology"], "procs_per_node": 2}}).dims == spec.dims
    # a global batch DeepSpeed derives the micro-batch from: over world / sp ranks
    derived, _ = from_deepspeed({"train_batch_size": 8, "gradient_accumulation_steps": 1,
                                 "sequence_parallel_size": 2},
                                given={"topology": {"procs_per_node": 4}})
    assert derived["micro_batch_size"] == 4 and derived["topology"]["cp"] == 2
    with pytest.raises(SpecError) as err:
        from_deepspeed({"sequence_parallel_size": "two"})
    assert "sequence_parallel_size" in dict(err.value.problems)


def test_what_a_tool_cannot_carry_is_refused_naming_the_field():
    ds = load_spec({"backend": "deepspeed", "topology": {"procs_per_node": 2, "cp": 2}})
    fsdp = load_spec({"backend": "fsdp", "topology": {"procs_per_node": 2, "cp": 2}})
    for tool, spec in (("accelerate", ds), ("hf-trainer", ds), ("hf-trainer", fsdp)):
        with pytest.raises(SpecError) as err:
            export_to(tool, spec)
        assert "topology.cp" in dict(err.value.problems), tool
    with pytest.raises(SpecError) as err:  # DeepSpeed's own key under native: the field is cp
        load_spec({"backend": "deepspeed", "deepspeed": {"native": {"sequence_parallel_size": 2}}})
    assert "set topology.cp" in dict(err.value.problems)["deepspeed.native.sequence_parallel_size"]


def test_accelerate_sp_size_beside_deepspeed_is_cp_and_other_keys_are_named():
    """accelerate 1.16 takes a ParallelismConfig beside DEEPSPEED for sequence parallelism (1.11
    refused it): sp_size over DeepSpeed's Ulysses is topology.cp on the DeepSpeed backend, as
    accelerate's own ParallelismConfig reads the same sizes. Under FSDP sp_size is refused naming
    cp_size; a key accelerate does not read is named, never dropped; its other sizes beside
    DEEPSPEED are refused."""
    from accelerate.parallelism_config import ParallelismConfig

    par = {"parallelism_config_sp_size": 2, "parallelism_config_sp_backend": "deepspeed",
           "parallelism_config_sp_seq_length": 64}
    theirs = ParallelismConfig(sp_size=2, sp_backend="deepspeed")  # accelerate's own reading
    assert theirs.sp_enabled and theirs.non_data_parallel_size == 2
    cfg = {"distributed_type": "DEEPSPEED", "num_processes": 4,
           "deepspeed_config": {"zero_stage": 2}, "parallelism_config": par}
    spec, report = from_accelerate(cfg)
    assert (spec["backend"], spec["topology"]["cp"]) == ("deepspeed", 2)
    assert load_spec(spec).dims.cp == 2 and load_spec(spec).dims.dp_size == 2
    assert ("parallelism_config.parallelism_config_sp_seq_length", "ignored") in {
        (src, outcome) for src, outcome, _ in report}
    fsdp = {"distributed_type": "FSDP", "num_processes": 4, "fsdp_config": {"fsdp_version": 2},
            "parallelism_config": {"parallelism_config_sp_size": 2}}
    with pytest.raises(SpecError) as err:
        from_accelerate(fsdp)
    assert "cp_size" in dict(err.value.problems)["parallelism_config.parallelism_config_sp_size"]
    typo = {**fsdp, "parallelism_config": {"parallelism_config_tp_sise": 2}}
    with pytest.raises(SpecError) as err:
        from_accelerate(typo)
    assert "tp_size" in dict(err.value.problems)["parallelism_config.parallelism_config_tp_sise"]
    with pytest.raises(SpecError) as err:
        from_accelerate({**cfg, "parallelism_config": {**par, "parallelism_config_tp_size": 2}})
    assert "parallelism_config" in dict(err.value.problems)
