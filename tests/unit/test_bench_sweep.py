"""`polyshard bench --seq A,B,... --budget GIB` (parallel/tools/bench/sweep.py): the lengths parse as a
sorted list, and a spec with cp gets the cp 1 layout beside it on the same ranks. The sweep itself
launches benches: tests/distributed/test_bench_plan.py runs one (make test-full)."""

import argparse

import pytest

from parallel.cli.args import seq_list
from parallel.spec.io import SpecError, load_spec
from parallel.tools.bench.sweep import layouts


def test_seq_takes_one_length_or_a_sweep():
    assert seq_list("64") == [64]
    assert seq_list("4096, 1024,2048,1024") == [1024, 2048, 4096]
    for bad in ("", "0", "1k", "2,-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            seq_list(bad)


def rows(spec) -> int:
    return spec.micro_batch_size * spec.grad_accum_steps * spec.dims.dp_size


def test_a_spec_with_cp_is_swept_beside_its_cp1_layout_on_the_same_global_batch():
    """cp 1 on the same ranks has cp times the data-parallel ranks: each takes 1/cp of the rows
    (it ran cp times the global batch, so cp 2 compared 2 rows a step against cp 1's 4)."""
    spec = load_spec({"backend": "fsdp", "micro_batch_size": 2, "global_batch_size": 4,
                      "topology": {"procs_per_node": 4, "cp": 2}})
    got = layouts(spec)
    assert list(got) == ["cp 1", "cp 2"] and got["cp 2"] is spec
    flat = got["cp 1"]
    assert (flat.world_size, flat.dims.dp_size, flat.topology.cp) == (4, 4, 1)
    assert rows(flat) == rows(spec) == 4 and flat.micro_batch_size == 1
    assert list(layouts(flat)) == ["cp 1"]
    accum = layouts(load_spec({"backend": "fsdp", "micro_batch_size": 1, "grad_accum_steps": 2,
                               "topology": {"procs_per_node": 4, "cp": 2}}))["cp 1"]
    assert accum.grad_accum_steps == 1 and rows(accum) == 4
    with pytest.raises(SpecError, match="micro_batch_size"):
        layouts(load_spec({"backend": "fsdp", "micro_batch_size": 1,
                           "topology": {"procs_per_node": 4, "cp": 2}}))
