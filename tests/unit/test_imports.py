"""`import parallel` and `polyshard validate` work without deepspeed, torch_xla or torchao."""

import subprocess
import sys

from parallel.registry import descriptors

BLOCK = ("import sys; sys.modules['deepspeed'] = None; sys.modules['torch_xla'] = None; "
         "sys.modules['torchao'] = None; ")


def test_every_descriptor_is_complete():
    """Each part answers for every variant: translate gives plain data, the plan model gives three
    byte counts and a volume, the native loop (where there is one) is a file in benchmarks/, the
    launch environment is strings, and the engine reference names a module:callable."""
    import json
    from pathlib import Path

    from parallel.spec.io import load_spec

    bench_dir = Path(__file__).resolve().parents[2] / "benchmarks"
    for d in descriptors():
        module, _, attr = d.engine.partition(":")
        assert module.startswith("backends.") and attr.isidentifier(), (d.name, d.engine)
        for name, overrides in (d.variants or {d.name: {}}).items():
            spec = load_spec({"backend": d.name, **overrides})
            json.dumps(d.translate(spec))  # plain data, or this raises
            states = d.plan.model_states(spec, [(64, 64), (64,)], 2, 4, 8)
            assert len(states) == 3 and all(x >= 0 for x in states), (name, states)
            assert d.plan.comm(spec, 1e6) > 0, name
            native = d.bench.native(spec)
            assert native is None or (bench_dir / native[0]).is_file(), (name, native)
            assert all(isinstance(v, str) for v in d.launch.env().values()), name


def run(code):
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True,
                          timeout=120)


def test_import_parallel_without_optional_backends():
    out = run("import parallel, parallel.cli.main, parallel.registry, parallel.launch.torchrun; "
              "print(parallel.load_spec({'backend': 'deepspeed'}).backend)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "deepspeed"
    lazy = subprocess.run([sys.executable, "-c", "import sys, parallel.cli.main, parallel.registry, "
                           "parallel.launch.torchrun; print('deepspeed' in sys.modules, "
                           "'torch_xla' in sys.modules, 'torchao' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert lazy.stdout.split() == ["False"] * 3, lazy.stderr  # imported only on demand


def test_validate_cli_without_optional_backends(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("backend: xla_fsdp\nshard: full\n")
    out = run(f"from parallel.cli.main import main; raise SystemExit(main(['validate', '{cfg}']))")
    assert out.returncode == 0, out.stderr
    assert "backend: xla_fsdp" in out.stdout


def test_validate_an_fp8_spec_without_torchao(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("backend: fsdp\nprecision: fp8\nfloat8: {recipe: rowwise}\n")
    out = run(f"from parallel.cli.main import main; raise SystemExit(main(['validate', '{cfg}']))")
    assert out.returncode == 0, out.stderr
