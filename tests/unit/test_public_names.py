"""The names users import stay importable: every `from parallel... import ...` and `import
parallel...` in README, docs/ and examples/ (what the docs show is the public surface), the package's
`__all__`, and import paths scripts wrote before a regroup (#65: `parallel.engine.evaluate` broke a
script when the engine was grouped by concern)."""

import importlib
import re
from pathlib import Path

import pytest

import parallel

ROOT = Path(__file__).resolve().parents[2]
FROM = re.compile(r"^\s*from (parallel(?:\.\w+)*) import \(?([\w, ]+)\)?", re.M)
PLAIN = re.compile(r"^\s*import (parallel(?:\.\w+)*)\s*$", re.M)
# paths from before a regroup that scripts wrote, kept (their new homes in the comments)
KEPT = [("parallel.engine.evaluate", "token_accuracy")]  # parallel/engine/infer/evaluate.py (an
# alias: parallel/engine/__init__.py)


def documented() -> list[tuple[str, str | None]]:
    names = set(KEPT) | {("parallel", n) for n in parallel.__all__}
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").rglob("*.py")]
    for path in files:
        text = path.read_text()
        for module, imported in FROM.findall(text):
            names |= {(module, n.strip()) for n in imported.split(",") if n.strip()}
        names |= {(module, None) for module in PLAIN.findall(text)}
    return sorted(names, key=str)


def test_the_documented_surface_is_found():
    found = documented()
    assert ("parallel", "create_engine") in found and ("parallel.launch", "current_spec") in found
    assert len(found) >= 10, found


@pytest.mark.parametrize("module,name", documented())
def test_a_documented_name_imports(module, name):
    imported = importlib.import_module(module)
    if name is not None:
        assert hasattr(imported, name), f"{module} has no {name}, which the docs import from it"
