"""polyshard: one training-strategy spec for torch FSDP, DeepSpeed ZeRO and PyTorch/XLA FSDP.

Layers, each importing only those below it: cli/ (the command) -> launch/ (processes) and tools/
(bench, parity, plan, dryrun) -> registry.py (which backends exist; assembles the spec) -> the
backends (backends/) -> the core: spec/ (the spec and its rules), engine/ (the engine every backend
implements), checkpoint/ (the portable format), dist.py (the process group), descriptor.py (what a
backend declares), interop/ (other tools' files: kits, and dispatchers that pick a backend),
files.py (bounded readers), heap.py (Python's garbage collector around saves, loads and
libraries' wraps), envinfo.py (facts of the host), and below them all kits/ (pure helpers every layer
may use: parameter names, sizes, the objective's counts, model limits); toy.py (the demo's model and
data) sits with the tools.

Importing this package needs neither deepspeed nor torch_xla: backends load lazily through the registry.
Its names load on first use, so a process that imports only `parallel.launch.agent` (torchrun's agent
under `polyshard launch`) does not pay for pydantic and the spec (about 0.1 s of every launch)."""

__version__ = "0.1.0"

__all__ = ["Spec", "SpecError", "dump_spec", "load_spec", "create_engine", "notebook_launch"]


def notebook_launch(fn, spec, *args, timeout=None) -> list:
    """Run `fn(spec, *args)` on every rank of `spec`'s job as child processes of this notebook or
    script; returns the ranks' results (parallel/launch/notebook.py)."""
    from parallel.launch.notebook import notebook_launch as _launch

    return _launch(fn, spec, *args, timeout=timeout)


def create_engine(spec):
    """Build the Engine for `spec.backend` (see parallel.registry)."""
    from parallel.registry import create_engine as _create

    return _create(spec)


def __getattr__(name: str):
    if name == "Spec":  # the spec with every registered backend's section (parallel/registry.py)
        from parallel.registry import spec_class

        return spec_class()
    if name == "SpecError":
        from parallel.spec.errors import SpecError

        return SpecError
    if name in ("dump_spec", "load_spec"):
        from parallel.spec import io

        return getattr(io, name)
    raise AttributeError(f"module 'parallel' has no attribute {name!r}")
