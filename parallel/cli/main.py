"""`polyshard`: validate, explain, launch, schema. Bad input prints `path: message` lines and exits 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from parallel.cli import ckpt as cli_ckpt, interop as cli_interop, plan as cli_plan
from parallel.cli.parser import build_parser, launch_flags
from parallel.spec.io import SpecError, dump_spec, json_schema, load_spec


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return HANDLERS[args.command](args)
    except SpecError as err:
        for path, message in err.problems:
            print(f"{path}: {message}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:  # unreadable or malformed input file: no traceback
        print(f"{args.command}: {err}", file=sys.stderr)
        return 2


def _overrides(args) -> list[str]:
    """--set's, then what --nproc / --nnodes set: what every emitted file's launch line carries too
    (a file that named the allocation in its header alone started one-node worlds)."""
    overrides = list(args.overrides)
    for flag, field in (("nproc", "topology.procs_per_node"), ("nnodes", "topology.nodes")):
        if getattr(args, flag, None) is not None:
            overrides.append(f"{field}={getattr(args, flag)}")
    return overrides


def _spec(args):
    world = getattr(args, "world", None)  # plan / dryrun: one number, the layout asked about
    return load_spec(Path(args.config), _overrides(args),
                     world=world if isinstance(world, int) else None)


def _validate(args) -> int:
    spec = _spec(args)  # the spec's rules and its backend's (translation included): parallel/spec
    print(dump_spec(spec, full=args.full), end="")
    print(f"# ok: backend {spec.backend}, {spec.world_size} rank(s), shard {spec.shard}",
          file=sys.stderr)
    from parallel.registry import local_layout

    note = local_layout(spec)[2]  # what `polyshard launch` will run on this host, if not as written
    if note:
        print(f"# {note}", file=sys.stderr)
    return 0


def _explain(args) -> int:
    from parallel.registry import explain

    spec = _spec(args)
    plan = explain(spec)
    if args.model:
        from parallel.engine.model.wrap import plan_wrap
        from parallel.tools.facts import check_model_layout
        from parallel.toy import meta_model

        model = meta_model(args.model)
        check_model_layout(model, spec.topology.tp, spec.topology.cp)
        plan["wrap_units"] = [name for name, _ in plan_wrap(model, spec.wrap)]
        if spec.topology.tp > 1:  # the split, checked against the model as prepare checks it
            from parallel.engine.model.tp_plan import describe

            plan["tp"] = describe(model, spec.topology.tp, spec.topology.tp_plan)
    print(json.dumps(plan, indent=2))
    return 0


def _launch(args) -> int:
    from parallel.launch.emit import tpu_vm_command
    from parallel.launch.torchrun import LaunchArgs, launch

    spec = _spec(args)
    script_args = [a for a in args.script_args if a != "--"]
    stray = [a for a in script_args if a.split("=", 1)[0] in launch_flags()]
    if stray:  # argparse hands everything after the script to it
        print(f"polyshard: {' '.join(stray)} comes after the script, so it goes to {args.script}, "
              "not to polyshard launch; polyshard's flags go before the spec", file=sys.stderr)
    if args.emit == "tpu-vm":
        print(tpu_vm_command(args.config, _overrides(args), args.script, script_args, args.tpu,
                             args.zone, args.workdir or "~/polyshard", nodes=spec.topology.nodes,
                             device=spec.topology.device, setup=args.setup))
        return 0
    if args.emit in ("slurm", "k8s"):
        import yaml

        from parallel.launch.emit import k8s_claim, k8s_manifest, slurm_script

        where = (args.config, _overrides(args), args.script, script_args)
        if args.emit == "slurm":
            print(slurm_script(spec, *where, job_name=args.job_name, time=args.time,
                               max_restarts=args.max_restarts, cpus_per_task=args.cpus_per_task,
                               setup=args.setup), end="")
            return 0
        job = k8s_manifest(spec, *where, image=args.image, name=args.job_name,
                           max_restarts=args.max_restarts, setup=args.setup,
                           workdir=args.workdir or "/opt/polyshard")
        claim = [k8s_claim(args.job_name, args.pvc_size)] if spec.checkpoint.dir else []
        print("# kubectl apply -f <this file>: the checkpoint volume (ReadWriteMany: a storage "
              "class that offers it) and the job\n" + yaml.safe_dump_all([*claim, job],
                                                                         sort_keys=False), end="")
        return 0
    launch_args = LaunchArgs(node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                             max_restarts=args.max_restarts)
    try:
        return launch(spec, launch_args, args.script, script_args, verbose=args.verbose)
    except ValueError as err:
        print(f"launch: {err}", file=sys.stderr)
        return 2


def _schema(args) -> int:
    text = json.dumps(json_schema(), indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


def _names(text: str | None) -> list[str]:
    """--backends: backend names and variants (fsdp1, zero2, xla1, ...); default every backend."""
    from parallel.registry import cell, names

    chosen = [x.strip() for x in text.split(",") if x.strip()] if text else names()
    for name in chosen:
        try:
            cell(name)
        except ValueError as err:
            raise SpecError([("--backends", str(err).removeprefix("--backends: "))]) from None
    return chosen


def _parity(args) -> int:
    from parallel.tools.parity.report import parity

    options = {"model": args.model, "steps": args.steps, "seq": args.seq,
               "optimizer": args.optimizer, "lr": args.lr}
    return parity(_spec(args), _names(args.backends), options, tol=args.tol, output=args.json)


def _bench(args) -> int:
    from rich.console import Console

    from parallel.tools.bench.report import bench
    from parallel.tools.bench.table import render

    spec = _spec(args)
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()] if text else None  # noqa: E731
    options = {"model": args.model, "steps": args.steps, "warmup": args.warmup, "seq": args.seq[0],
               **({"data": args.data} if args.data else {}),
               **({"optimizer": args.optimizer} if args.optimizer != "adamw" else {})}
    if args.optimizer != "adamw" and args.vs_native:
        raise SpecError([("--optimizer", f"{args.optimizer} with --vs-native: the hand-written "
                          "loops in benchmarks/ train AdamW; drop one of the two")])
    if args.data and args.vs_native:
        raise SpecError([("--data", f"{args.data!r} with --vs-native: the hand-written loops in "
                          "benchmarks/ train on the shared random ids only; drop one of the two")])
    if args.data:
        from parallel.toy import load_factory

        if load_factory(args.data, "--data", "a function returning the global batches") is None:
            raise SpecError([("--data", f"{args.data!r} is not module:function (a function in a "
                              "module importable from the working directory)")])
    console = Console(stderr=True)
    if len(args.seq) > 1 or args.budget is not None:  # a sweep over lengths (tools/bench/sweep.py)
        from parallel.tools.bench.sweep import render_sweep, seq_sweep

        result = seq_sweep(spec, _names(args.backends), args.seq, args.budget, options,
                           Path(args.out), say=lambda line: console.print(line, highlight=False))
        render_sweep(result, Console(width=200))
        return 0 if any(r["ran"] for r in result["rows"]) else 1
    results = bench(spec, _names(args.backends), split(args.shard),
                    [int(w) for w in split(args.world) or []], options, Path(args.out),
                    say=lambda line: console.print(line, highlight=False), vs_native=args.vs_native,
                    profile=args.profile, save=args.save, precisions=split(args.precision))
    render(results, Path(args.out), wide=args.wide)
    if args.startup:
        from parallel.tools.bench.startup import measure_startup

        got = measure_startup(spec, args.model, args.seq[0], pairs=args.startup)
        (Path(args.out) / "startup.json").write_text(json.dumps(got, indent=1))
        console.print(got.get("skipped") or (
            f"start-up to the first step ({spec.backend}, {spec.world_size} rank(s), median of "
            f"{got['pairs']} pairs): polyshard launch {got['polyshard_s']:.2f} s, torchrun "
            f"{got['native']} {got['native_s']:.2f} s, {got['ratio']:.3f}x"), highlight=False)
    return 0 if all("error" not in r for r in results.values()) else 1


def _plan(args) -> int:
    if args.sweep:
        return cli_plan.run_sweep(args, lambda extra: load_spec(
            Path(args.config), _overrides(args) + extra, world=args.world))
    return cli_plan.run_plan(_spec(args), args)


HANDLERS = {"validate": _validate, "explain": _explain, "launch": _launch, "schema": _schema,
            "ckpt": cli_ckpt.run, "parity": _parity, "bench": _bench, "plan": _plan,
            "dryrun": lambda args: cli_plan.run_dryrun(_spec(args), args), "import": cli_interop.run_import,
            "export": lambda args: cli_interop.run_export(args, _spec(args))}

if __name__ == "__main__":
    sys.exit(main())
