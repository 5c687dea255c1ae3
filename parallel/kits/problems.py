"""The error every layer raises for input that cannot be used: `(field path, message)` pairs whose
message names the value, the rule and a fix, so the CLI prints `path: message` lines and exits 2
without a traceback. Defined in this kit so that what sits below the spec (kits/device.py: the
device a spec names, checked on the host that runs it) raises the same error; parallel.spec.errors
re-exports it with the spec's helpers."""

from __future__ import annotations


class SpecError(ValueError):
    """A spec that cannot be used; `problems` holds `(path, message)` pairs."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("\n".join(f"{p}: {m}" for p, m in problems))
