"""Tests that this host skips (tests/distributed/test_gpu.py on a machine without CUDA) still name
only what exists: every name a test file imports from the suite's own helper modules, and every
`module.attribute` it reads from one it imported whole, is defined at that module's top level.
test_gpu.py kept calling `test_faults.fault_run` after the shared launches (3a8e4df) removed it;
only a GPU run found it. Static (ast), so it runs in a second on any host."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
DIST = TESTS / "distributed"


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
    return names


def local_module(name: str) -> Path | None:
    for folder in (DIST, TESTS):
        if (folder / f"{name}.py").is_file():
            return folder / f"{name}.py"
    return None


def unresolved(path: Path) -> list[str]:
    tree, missing, whole = ast.parse(path.read_text()), [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and (source := local_module(node.module)):
            missing += [f"{path.name}: from {node.module} import {a.name}" for a in node.names
                        if a.name not in top_level_names(source)]
        elif isinstance(node, ast.Import):
            whole.update({a.asname or a.name: src for a in node.names
                          if (src := local_module(a.name))})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in whole and node.attr not in top_level_names(whole[node.value.id]):
            missing.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return missing


def test_every_test_file_names_only_what_its_helpers_define():
    files = sorted(DIST.glob("*.py")) + sorted(TESTS.glob("*.py"))
    assert DIST / "test_gpu.py" in files
    missing = [m for f in files for m in unresolved(f)]
    assert not missing, missing


def test_the_check_finds_a_removed_helper(tmp_path):
    """The check itself can fail: a name test_faults.py or harness.py does not define is reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("import test_faults as faults\nfrom harness import no_such_helper\n"
                     "faults.fault_run(1)\nfaults.launch(2)\n")
    assert unresolved(probe) == ["probe.py: from harness import no_such_helper",
                                 "probe.py:3: faults.fault_run"]
