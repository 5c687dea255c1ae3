"""`polyshard`: the command line (main.py, run as `python -m parallel.cli` by __main__.py), with
`ckpt` (ckpt.py), `import/export` (interop.py) and `plan` (plan.py) in their modules, and
every subcommand's arguments in parser.py, their numbers bounded by args.py."""


def main(argv=None) -> int:
    from parallel.cli.main import main as run

    return run(argv)
