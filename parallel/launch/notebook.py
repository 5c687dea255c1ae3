"""`notebook_launch(fn, spec, *args)`: a job's ranks as child processes of a notebook or a plain
`python` process, as Accelerate's `notebook_launcher` does, for every backend that runs on one host.

Each child gets what torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT), the backend's launch environment (registry: `launch.env`, and `local_run`'s on a
host that lays the job out differently, e.g. XLA's single-process CPU client) and the spec (so
`current_spec()` works), then calls `fn(spec, *args)`. The call returns every rank's return value,
in rank order; the first rank to fail raises here with its traceback and the other ranks are ended
(a rank left waiting in a collective for its failed peer would otherwise never return).

Each rank is a fresh interpreter (`python -m parallel.launch.notebook`), `fn` and `args` carried by
`dill` (by value where they live in `__main__`: a notebook cell or the script itself, which is never
run again, so no `if __name__ == "__main__"` guard is needed), the result coming back in a file.
Not forked: once this process has run autograd (a notebook usually has), a forked rank's backward
fails (measured, torch 2.9: after one backward in the parent, FSDP2's backward in the child raised
"device_ready_queues_ ... INTERNAL ASSERT FAILED"), and a forked child cannot use CUDA again.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path


def plan(spec) -> tuple[object, int, dict[str, str]]:
    """(the spec as this host runs it, processes to start, the environment every rank shares)."""
    from parallel.registry import get, local_run
    from parallel.spec.io import load_spec

    if spec.topology.nodes != 1:
        raise ValueError(f"notebook_launch: topology.nodes is {spec.topology.nodes}; a notebook "
                         "starts ranks on its own host only: set nodes: 1, or use `polyshard "
                         "launch` on every node")
    data, env = local_run(spec)
    env = {k: os.environ.get(k, v) for k, v in env.items()}  # a value the user exported wins
    run = load_spec(data)
    refusal = get(run.backend).launch.in_process_refusal(run)
    if refusal:
        raise ValueError(f"notebook_launch: {refusal}")
    return run, run.topology.procs_per_node, env


def notebook_launch(fn: Callable, spec, *args, timeout: float | None = None) -> list:
    """Run `fn(spec, *args)` on every rank of `spec`'s job (a Spec, a dict or a YAML path) as
    child processes; return their results in rank order. `timeout`: seconds for the whole job,
    after which every rank is ended and TimeoutError raised."""
    import dill
    import torch.distributed as dist

    from parallel.launch.lanes import interpreter
    from parallel.launch.ranks import job_ranks
    from parallel.launch.torchrun import launch_env
    from parallel.spec.io import load_spec

    if dist.is_initialized():
        raise RuntimeError("notebook_launch: this process already joined a process group (an "
                           "engine was created here); restart the kernel, then launch")
    spec = spec if hasattr(spec, "model_dump") else load_spec(spec)
    run, nproc, env = plan(spec)
    with tempfile.TemporaryDirectory(prefix="polyshard-nb-") as tmp:
        tmp, data = Path(tmp), run.model_dump(mode="json", exclude_unset=True)
        (tmp / "job.dill").write_bytes(dill.dumps((fn, data, args), recurse=True))
        (tmp / "spec.json").write_text(json.dumps(data))  # current_spec() in the ranks reads it
        python = interpreter(run.backend)  # the backend's lane (lanes.py)
        # the notebook's own import paths; another lane's python keeps its own packages
        paths = [p for p in sys.path if python == sys.executable
                 or not p.startswith((sys.prefix, sys.base_prefix))]
        shared = {**launch_env(run, tmp / "spec.json"), **env,
                  "PYTHONPATH": os.pathsep.join(paths)}
        with job_ranks([python, "-P", "-m", "parallel.launch.notebook", str(tmp / "job.dill"),
                        str(tmp / "rank")], nproc, shared) as procs:
            return _collect(procs, tmp, timeout)


def _collect(procs: list, tmp: Path, timeout: float | None) -> list:
    """Every rank's result, or the first failure (an error it sent back, or how it ended)."""
    import dill

    from parallel.launch.ranks import wait_ranks

    failed, late = wait_ranks(procs, timeout)
    if failed is not None:
        error = tmp / f"rank{failed}.error"
        said = error.read_text() if error.is_file() else (
            f"it ended with exit code {procs[failed].returncode} and no error of its own "
            "(killed, or it called exit)")
        raise RuntimeError(f"notebook_launch: rank {failed} failed; every rank was ended. "
                           f"Its error:\n{said}")
    if late:
        raise TimeoutError(f"notebook_launch: the job was still running after {timeout:.0f} s; "
                           "every rank was ended")
    return [dill.loads((tmp / f"rank{r}").read_bytes()) for r in range(len(procs))]


def _child(job: str, prefix: str) -> int:
    """`prefix` + this rank's number: where its result (or `.error`) goes."""
    import dill

    from parallel.spec.io import load_spec

    from parallel.launch.agent import listen_on_loopback

    listen_on_loopback()  # any store server a rank starts: on 127.0.0.1 only (the job's is the parent's)
    out = prefix + os.environ["RANK"]
    try:
        fn, data, args = dill.loads(Path(job).read_bytes())
        result = fn(load_spec(data), *args)
    except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent, named
        Path(out + ".error").write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        return 1
    Path(out + ".tmp").write_bytes(dill.dumps(result))
    os.replace(out + ".tmp", out)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
