"""`polyshard bench --seq A,B,... --budget GIB` (parallel/tools/bench/sweep.py): the lengths parse as a
sorted list, and a spec with cp gets the cp 1 layout beside it on the same ranks. The sweep itself
launches benches: tests/distributed/test_bench_plan.py runs one (make test-full)."""

import argparse

import pytest

from parallel.cli.args import seq_list
from parallel.spec.io import load_spec
from parallel.tools.bench.sweep import layouts


def test_seq_takes_one_length_or_a_sweep():
    assert seq_list("64") == [64]
    assert seq_list("4096, 1024,2048,1024") == [1024, 2048, 4096]
    for bad in ("", "0", "1k", "2,-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            seq_list(bad)


def test_a_spec_with_cp_is_swept_beside_its_cp1_layout():
    spec = load_spec({"backend": "fsdp", "micro_batch_size": 1, "global_batch_size": 2,
                      "topology": {"procs_per_node": 4, "cp": 2}})
    got = layouts(spec)
    assert list(got) == ["cp 1", "cp 2"] and got["cp 2"] is spec
    flat = got["cp 1"]
    assert (flat.world_size, flat.dims.dp_size, flat.topology.cp) == (4, 4, 1)
    assert list(layouts(flat)) == ["cp 1"]
