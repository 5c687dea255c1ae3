"""checkpoint.dir must be one directory for every rank (parallel/engine/state/shared_dir.py): two
gloo ranks, each given its own root (as two nodes that each mount a local disk at the path) fail at
start naming checkpoint.dir on both ranks; given one root they pass, and the probe file is gone."""

import json
import os
import subprocess
import sys
from pathlib import Path

from parallel.dist import free_port

WORKER = """
import json, sys, torch, torch.distributed as dist
from parallel.engine.state.shared_dir import check_shared
from parallel.spec.errors import SpecError
dist.init_process_group("gloo")
root, out = sys.argv[1], sys.argv[2]
try:
    check_shared(root, dist.get_rank(), torch.device("cpu"))
    result = "ok"
except SpecError as err:
    result = str(err)
open(out, "w").write(json.dumps(result))
dist.destroy_process_group()
"""


def run(tmp: Path, roots: list[Path]) -> list[str]:
    port = str(free_port())
    procs = []
    for rank, root in enumerate(roots):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
               "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(root),
                                       str(tmp / f"out{rank}.json")], env=env))
    for p in procs:
        assert p.wait(timeout=120) == 0
    return [json.loads((tmp / f"out{r}.json").read_text()) for r in range(2)]


def test_a_directory_every_rank_sees_passes_and_is_left_as_it_was(tmp_path):
    root = tmp_path / "ckpt"
    assert run(tmp_path, [root, root]) == ["ok", "ok"]
    assert list(root.iterdir()) == []  # the probe was rank 0's and is gone


def test_a_directory_of_each_nodes_own_is_refused_on_every_rank(tmp_path):
    results = run(tmp_path, [tmp_path / "node0", tmp_path / "node1"])
    assert all(r.startswith("checkpoint.dir: ") and "not one directory for every rank" in r
               for r in results), results
    assert "this rank sees it" in results[0] and "does not" in results[1], results
    assert list((tmp_path / "node0").iterdir()) == []
