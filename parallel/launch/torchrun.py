"""Starting processes: `polyshard launch` runs torchrun with the spec's topology and hands the validated
spec to every rank through POLYSHARD_SPEC (a JSON file), so a script never re-parses flags."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from parallel.launch.lanes import interpreter
from parallel.registry import get
from parallel.spec.model import Spec
from parallel.spec.io import load_spec

SPEC_ENV = "POLYSHARD_SPEC"


class NoSpecError(RuntimeError):
    """A script asked for its spec outside `polyshard launch` and named none."""


def current_spec(default: str | Path | dict | None = None, overrides: list[str] = ()) -> Spec:
    """The spec this process runs under: the one `polyshard launch` passed (POLYSHARD_SPEC), else
    `default` (a spec file or dict the script names). Never the built-in defaults silently: with
    neither, it stops and says how to give one."""
    from parallel.dist import install_error_report

    install_error_report()  # under a launcher: the first failing rank is reported once
    passed = os.environ.get(SPEC_ENV)
    if passed:
        return load_spec(Path(passed), list(overrides))
    if default is None:
        raise NoSpecError(
            "no spec: this script was not started by `polyshard launch` (which passes one through "
            f"{SPEC_ENV}) and names none. Run `polyshard launch SPEC.yaml {Path(sys.argv[0]).name}`, "
            f"or set {SPEC_ENV}=SPEC.yaml, or call current_spec(default='SPEC.yaml') in the script")
    spec = load_spec(default, list(overrides))
    if int(os.environ.get("RANK", "0")) == 0:  # said once, so a forgotten launcher is noticed
        where = default if isinstance(default, (str, Path)) else "the dict the script passes"
        print(f"polyshard: spec from {where} (not started by `polyshard launch`)", file=sys.stderr,
              flush=True)
    return spec


@dataclass
class LaunchArgs:
    """torchrun's flags beyond the topology (which comes from the spec)."""

    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    extra: list[str] = field(default_factory=list)


def torchrun_command(spec: Spec, args: LaunchArgs, script: str, script_args: list[str]) -> list[str]:
    nnodes = spec.topology.nodes
    # torchrun's own launcher, reporting a failure once (parallel/launch/agent.py), in the Python of
    # the backend's lane (lanes.py: torch_xla's own torch where it lives apart)
    cmd = [interpreter(spec.backend), "-P", "-m", "parallel.launch.agent",
           "--nproc-per-node", str(spec.topology.procs_per_node),
           "--nnodes", str(nnodes), "--max-restarts", str(args.max_restarts)]
    endpoint = args.rdzv_endpoint or spec.topology.rdzv_endpoint
    if nnodes == 1 and not endpoint:
        cmd.append("--standalone")  # a private rendezvous on a free port: parallel jobs never clash
    else:
        if not endpoint:
            raise ValueError("--rdzv-endpoint HOST:PORT (or topology.rdzv_endpoint) is required "
                             "with more than one node")
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
        if args.node_rank is not None:
            cmd += ["--node-rank", str(args.node_rank)]
    # "--" ends torchrun's options: a script flag such as --log would otherwise be taken as an
    # abbreviation of torchrun's --log-dir (measured: "ambiguous option: --log").
    return cmd + args.extra + ["--", script, *script_args]


def launch_env(spec: Spec, spec_file: Path) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in get(spec.backend).launch.env().items():
        env.setdefault(key, value)  # a value the user exported wins
    env[SPEC_ENV] = str(spec_file)
    env.setdefault("OMP_NUM_THREADS", "1")  # ranks share the host's cores; torchrun warns otherwise
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # gloo's per-connection chatter
    # NCCL (GPU jobs): a failed or timed-out collective aborts the communicator and raises instead
    # of hanging, and the flight recorder dumps the last collectives of every rank on timeout.
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    return env


def launch(spec: Spec, args: LaunchArgs, script: str, script_args: list[str],
           verbose: bool = False) -> int:
    """Run `script` on every rank under `spec`, laid out as this host's runtime supports
    (registry.local_layout: said in one line when that differs from the spec as written); return
    the launcher's exit code. Third-party start-up noise is filtered unless `verbose`."""
    from parallel.kits.device import launch_env as device_env
    from parallel.kits.device import resolve
    from parallel.registry import local_layout

    check_allocation(spec)  # a scheduler's node count the spec disagrees with: one world each
    kind = resolve(spec.topology.device)  # a device this host lacks: refused before any rank starts
    t = spec.topology
    runtime = device_env(kind, t.nodes, t.procs_per_node)  # TorchTPU's slice, decided here
    args = _rendezvous(args, runtime, t.rdzv_endpoint)
    data, local_env, note = local_layout(spec)
    if note:
        print(f"polyshard: {note}", file=sys.stderr, flush=True)
        spec = load_spec(data)
    with tempfile.TemporaryDirectory(prefix="polyshard-") as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec.model_dump(mode="json", exclude_unset=True)))
        cmd = torchrun_command(spec, args, script, script_args)
        env = {**launch_env(spec, spec_file), **runtime, **local_env}
        if verbose:
            proc, relays = subprocess.Popen(cmd, env=env), []
        else:  # gloo's peer lines and torchrun's banner dropped (quiet.py)
            from parallel.launch.quiet import quiet_streams

            out, err, start = quiet_streams()
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err)
            relays = start()
        # A preemption notice sent to `polyshard launch` goes on to the agent, which passes it to
        # the workers (parallel/launch/agent.py); the exit code (85: requeue) comes back.
        for name in ("SIGTERM", "SIGUSR1"):
            signal.signal(getattr(signal, name), lambda signum, frame: proc.send_signal(signum))
        code = proc.wait()
        for relay in relays:
            relay.thread.join(timeout=30)  # the workers' last lines, before we return
        return code


def check_allocation(spec: Spec, env=None) -> None:
    """Under a cluster scheduler, the nodes it started this launch on are the spec's
    topology.nodes: otherwise each node would run a world of its own into the same checkpoint
    directory (torchrun takes the --nnodes polyshard passes over Kubeflow's PET_NNODES)."""
    from parallel.envinfo import scheduler_nodes
    from parallel.spec.errors import SpecError

    found = scheduler_nodes(env)
    nodes = spec.topology.nodes
    if found is None or found[2] == nodes:
        return
    name, value, count = found
    raise SpecError([("topology.nodes", f"{nodes}, but this launch runs under a scheduler that "
                      f"gave it {count} node(s) ({name}={value}): each node would start a "
                      f"{nodes}-node world of its own; set topology.nodes: {count} (--nnodes "
                      f"{count}), or allocate {nodes} node(s)")])


def _rendezvous(args: LaunchArgs, runtime: dict[str, str], written: str | None) -> LaunchArgs:
    """The node rank and rendezvous a device runtime decided (TorchTPU's, from the slice's
    hosts), where neither the command line nor the spec (`written`) named them: every worker of a
    slice runs the same command."""
    if "MASTER_ADDR" not in runtime and "NODE_RANK" not in runtime:
        return args
    endpoint = args.rdzv_endpoint or written or (
        f"{runtime['MASTER_ADDR']}:{runtime.get('MASTER_PORT', 29500)}"
        if "MASTER_ADDR" in runtime else None)
    rank = args.node_rank if args.node_rank is not None else int(runtime.get("NODE_RANK", 0))
    return LaunchArgs(rank, endpoint, args.max_restarts, args.extra)


def run_locally(spec: Spec, module: str, args: list[str], out: Path, timeout: float,
                devices: int | None = None) -> dict:
    """Run `python -m module args` (or the script at path `module`) on every rank of `spec`'s job on
    this host, laid out as the backend's runtime needs here (registry.local_run), and return the JSON
    it wrote to `out`, or {"error": the output's tail}. Parity and bench cells: a fresh launch each."""
    from parallel.registry import local_run

    data, env = local_run(spec, devices)
    run_spec = load_spec(data)
    with tempfile.TemporaryDirectory(prefix="polyshard-run-") as tmp:
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(data))
        extra = [] if module.endswith(".py") else ["-m"]
        cmd = torchrun_command(run_spec, LaunchArgs(extra=extra), module, [*args, f"--out={out}"])
        try:
            proc = subprocess.run(cmd, env={**launch_env(run_spec, spec_file), **env},
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0 or not out.is_file():
        return {"error": (proc.stdout + proc.stderr)[-4000:]}
    return {**json.loads(out.read_text()), "procs": run_spec.topology.procs_per_node,
            "micro_batch_size": run_spec.micro_batch_size}
