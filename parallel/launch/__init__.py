"""Starting processes: torchrun with the spec's topology (torchrun.py), the agent that reports a
failed job once (agent.py), the workers' output without third-party noise (quiet.py), a job's ranks
from a notebook (notebook.py), a one-host job's ranks without an agent process (ranks.py: the
notebook's and the test harness's), cluster files (emit.py), the Python a backend's ranks start in
(lanes.py: torch_xla's own torch, in a lane of its own).

`from parallel.launch import current_spec` works; the names load on first use, so importing a
submodule does not import the launcher."""

_EXPORTS = {"SPEC_ENV", "LaunchArgs", "NoSpecError", "current_spec", "launch"}


def __getattr__(name: str):
    if name in _EXPORTS:
        from parallel.launch import torchrun

        return getattr(torchrun, name)
    raise AttributeError(f"module 'parallel.launch' has no attribute {name!r}")
