"""`polyshard`: the command line (main.py), with `ckpt`, `import/export` and `plan` in their modules."""


def main(argv=None) -> int:
    from parallel.cli.main import main as run

    return run(argv)
