"""The codebase's shape, held by tests so it stays cheap to change (issue #40):

- no import cycles in parallel/ and backends/ (imports inside functions included);
- kits apart from dispatchers: a dispatcher imports the registry (it picks a backend); no backend
  module imports one, and the spec's own model imports no backend;
- a backend overrides the hooks of parallel/engine/core/hooks.py and nothing else of the Engine;
- each backend's model set-up (`_prepare`) is a short sequence of apply_* steps;
- the engine package lists as its architecture, and every package docstring names its modules;
- files stay within their size (core <= 300 lines, a backend's <= 400, functions <= 60);
- every backend's own spec section comes from its descriptor, none is declared in core.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("parallel", "backends")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = modules()


def _resolve(name: str) -> str | None:
    """The module of ours `name` refers to (a module, or an attribute of one), else None."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(module: str) -> set[str]:
    """Every module of ours that `module` imports, at any depth of its code."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {_resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import submodule` names the submodule
                out.add(_resolve(f"{base}.{alias.name}") or _resolve(base))
    return {m for m in out if m and m != module}


GRAPH = {m: imports(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_the_walker_sees_imports_inside_functions():
    # the registry imports the spec's model only inside a function: still an edge
    assert "parallel.spec.model" in GRAPH["parallel.registry"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


DISPATCHERS = {m for m, deps in GRAPH.items() if "parallel.registry" in deps}


def test_backends_import_no_dispatcher():
    """A dispatcher picks a backend through the registry; a backend module that imported one would
    import (through the registry) every backend, itself included."""
    offending = {m: sorted(GRAPH[m] & DISPATCHERS) for m in GRAPH
                 if m.startswith("backends.") and GRAPH[m] & DISPATCHERS}
    assert offending == {}
    # what a dispatcher is, by example: load_spec picks the spec class the registry assembles
    assert {"parallel.spec.io", "parallel.interop.accelerate", "parallel.interop.export"} <= DISPATCHERS


def test_core_layers_import_upward_nothing():
    """The spec, the engine, checkpoints and the process group import no launcher, tool, CLI or
    registry (cli -> launch -> registry -> backends -> core)."""
    core = ("parallel.spec.model", "parallel.spec.sections", "parallel.spec.errors",
            "parallel.spec.dims", "parallel.engine", "parallel.checkpoint", "parallel.dist",
            "parallel.descriptor", "parallel.files", "parallel.envinfo")
    upward = ("parallel.registry", "parallel.launch", "parallel.cli", "backends")
    bad = {m: sorted(d for d in GRAPH[m] if d.startswith(upward)) for m in GRAPH
           if m.startswith(core) and any(d.startswith(upward) for d in GRAPH[m])}
    assert bad == {}


# The house, top to bottom: a module imports only modules of its own package or of a lower layer
# (the longest prefix names a module's layer; a dispatcher, which picks a backend through the
# registry, sits above the registry wherever its file is).
LAYERS = [
    # the jobs bench launches are written as a user's script is, against the package's facade
    ("parallel.tools.bench.jobs",), ("parallel",), ("parallel.cli",),
    ("parallel.tools", "parallel.toy"), ("parallel.launch",),
    ("dispatchers",), ("parallel.registry",), ("backends",), ("parallel.interop",),
    ("parallel.engine",), ("parallel.engine.core",), ("parallel.engine.infer",),
    ("parallel.engine.state",), ("parallel.engine.observe",), ("parallel.engine.model",),
    ("parallel.engine.data",), ("parallel.engine.watch",),
    ("parallel.checkpoint",), ("parallel.checkpoint.importers", "parallel.checkpoint.hf"),
    ("parallel.checkpoint.background",), ("parallel.checkpoint.state",),
    ("parallel.checkpoint.format",), ("parallel.descriptor",), ("parallel.spec",),
    ("parallel.dist",), ("parallel.files", "parallel.heap", "parallel.envinfo"), ("parallel.kits",),
]


def layer(module: str) -> tuple[int, str]:
    """(depth: 0 is the top, the prefix that placed it)."""
    best = max((p for names in LAYERS for p in names
                if module == p or module.startswith(p + ".")), key=len)
    own = next(i for i, names in enumerate(LAYERS) if best in names), best
    lifted = next(i for i, names in enumerate(LAYERS) if "dispatchers" in names), "dispatchers"
    return lifted if module in DISPATCHERS and lifted[0] < own[0] else own


def test_no_import_runs_up_the_layers():
    """0 arrows up: every import goes to the module's own package or below (#65: tools/sizes.py and
    measurable.py under backends, clean_name in the engine, the objective in engine/core, checkpoint
    code importing the demo's toy.py and its packages importing each other both ways, all were)."""
    up = []
    for m, deps in GRAPH.items():
        depth, home = layer(m)
        for d in deps:
            d_depth, d_home = layer(d)
            if d_depth < depth and d_home != home:
                up.append(f"{m} ({home}) -> {d} ({d_home})")
    assert up == [], "\n".join(sorted(up))


def test_the_checkpoint_packages_read_as_their_architecture():
    for package in ("checkpoint", "checkpoint/format", "checkpoint/state", "checkpoint/background",
                    "checkpoint/hf", "kits"):
        entries = [p.name for p in (ROOT / "parallel" / package).iterdir() if p.name != "__pycache__"]
        assert len(entries) <= 8, (package, sorted(entries))


def engine_classes():
    from parallel import registry

    classes = set()
    for descriptor in registry.descriptors():
        module = registry.load(descriptor, descriptor.engine).__module__
        package = module.rpartition(".")[0]
        for name, path in MODULES.items():
            if name.startswith(package + ".") and "class " in path.read_text():
                mod = __import__(name, fromlist=["x"])
                classes |= {c for _, c in inspect.getmembers(mod, inspect.isclass)
                            if c.__module__ == name}
    return classes


def test_backends_override_hooks_only():
    from parallel.engine.core.engine import Engine
    from parallel.engine.core.hooks import BackendHooks

    pytest.importorskip("deepspeed")
    pytest.importorskip("torch_xla")
    hooks = set(vars(BackendHooks))
    ours = {name for cls in Engine.__mro__ if cls.__module__.startswith("parallel.engine")
            and cls is not BackendHooks for name in vars(cls)} - hooks
    engines = [c for c in engine_classes() if issubclass(c, Engine)]
    assert len(engines) >= 5, engines  # FSDP2, FSDP1, DeepSpeed, XLA v1 and SPMD (and bases)
    overridden = {f"{c.__module__}.{c.__qualname__}.{name}" for c in engines for name in vars(c)
                  if name in ours and not name.startswith("__")}
    assert overridden == set(), "a backend overrides what is not a hook of engine/core/hooks.py"


def test_an_override_outside_the_hooks_is_caught():
    from parallel.engine.core.engine import Engine

    class Sneaky(Engine):
        def close(self):  # not a hook: the Engine's own
            pass

    from parallel.engine.core.hooks import BackendHooks

    ours = {name for cls in Engine.__mro__ if cls.__module__.startswith("parallel.engine")
            and cls is not BackendHooks for name in vars(cls)} - set(vars(BackendHooks))
    assert "close" in ours and "close" in vars(Sneaky)


def _body_lines(fn) -> int:
    """Lines of code in a function's body: no docstring, comments or blank lines."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    lines = set()
    for node in body:
        for sub in ast.walk(node):
            if hasattr(sub, "lineno"):
                lines |= set(range(sub.lineno, getattr(sub, "end_lineno", sub.lineno) + 1))
    source = textwrap.dedent(inspect.getsource(fn)).splitlines()
    return sum(1 for n in lines if source[n - 1].strip() and not source[n - 1].strip().startswith("#"))


def test_each_backend_sets_its_model_up_in_a_short_sequence_of_steps():
    from parallel.engine.core.engine import Engine

    pytest.importorskip("deepspeed")
    pytest.importorskip("torch_xla")
    long = {f"{c.__qualname__}: {_body_lines(c._prepare)}" for c in engine_classes()
            if issubclass(c, Engine) and "_prepare" in vars(c) and _body_lines(c._prepare) > 25}
    assert long == set()


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def test_the_engine_package_reads_as_its_architecture():
    entries = sorted(p.name for p in (ROOT / "parallel" / "engine").iterdir()
                     if p.name != "__pycache__")
    assert len(entries) <= 8, entries
    assert {"core", "data", "model", "watch", "observe", "infer", "state"} <= set(entries)


@pytest.mark.parametrize("package", sorted({p.parent for p in (ROOT / "parallel").rglob("__init__.py")}
                                           | {p.parent for p in (ROOT / "backends").rglob(
                                               "__init__.py")}), ids=str)
def test_every_package_docstring_names_its_modules(package):
    text = _docstring(package / "__init__.py")
    children = [p.name for p in package.iterdir() if p.suffix == ".py" and p.name != "__init__.py"]
    children += [f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file()]
    missing = [c for c in children if c not in text]
    assert missing == [], f"{package.relative_to(ROOT)}/__init__.py's docstring does not name {missing}"


def test_readme_layout_block_is_the_tree():
    """README's layout block lists each top-level package and each of its subpackages as they are."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- layout:begin -->")[1].split("<!-- layout:end -->")[0]
    named = {line.split()[0].rstrip("/") for line in block.strip("`\n").splitlines()
             if line.strip() and not line.startswith(("```", " "))}
    for package in ("parallel", "backends"):
        here = {f"{package}/{p.name}" for p in (ROOT / package).iterdir()
                if (p / "__init__.py").is_file()}
        for sub in here:
            assert sub in named, f"README's layout block lacks {sub}"
    stale = {n for n in named if "/" in n and not (ROOT / n).exists()}
    assert stale == set(), f"README's layout block names what is gone: {stale}"


LIMITS = {"parallel": 300, "backends": 400}


def test_files_and_functions_stay_within_their_size():
    big = {}
    for name, path in MODULES.items():
        limit = LIMITS[name.split(".")[0]]
        lines = len(path.read_text().splitlines())
        if lines > limit:
            big[str(path.relative_to(ROOT))] = lines
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                span = node.end_lineno - node.lineno + 1
                if span > 60:
                    big[f"{path.relative_to(ROOT)}:{node.name}"] = span
    assert big == {}


def test_backend_sections_come_from_their_descriptors():
    from parallel import registry
    from parallel.spec.model import Spec

    assembled = registry.spec_class()
    sections = {d.options.section: d.options.model for d in registry.descriptors() if d.options}
    assert set(sections) == {"fsdp", "deepspeed", "xla"}
    for name, model in sections.items():
        assert name not in Spec.model_fields  # not declared in core
        assert assembled.model_fields[name].annotation is model
        assert model.__module__.startswith("backends."), model
    assert issubclass(assembled, Spec) and assembled.backends is registry
    with pytest.raises(TypeError, match="load_spec"):
        Spec()  # the spec's own fields alone validate no backend


LINE_LIMIT = 110  # ruff's E501 at this length (pyproject.toml): a file splits, lines do not widen


def test_no_line_is_wider_than_the_limit():
    """#65: 518 lines were over 100 characters and 43 over 110, as files grew sideways instead of
    splitting along a seam. Every Python file of the project stays within the limit."""
    wide = {}
    for folder in ("parallel", "backends", "tests", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if len(line) > LINE_LIMIT:
                    wide[f"{path.relative_to(ROOT)}:{n}"] = len(line)
    assert wide == {}
