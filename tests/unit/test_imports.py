"""`import parallel` and `polyshard validate` work without deepspeed or torch_xla."""

import subprocess
import sys

from parallel.registry import descriptors

BLOCK = "import sys; sys.modules['deepspeed'] = None; sys.modules['torch_xla'] = None; "


def test_every_descriptor_is_complete():
    for d in descriptors():
        assert d.translate and d.engine and d.plan and d.bench.native, d.name


def run(code):
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True,
                          timeout=120)


def test_import_parallel_without_optional_backends():
    out = run("import parallel, parallel.cli.main, parallel.registry, parallel.launch.torchrun; "
              "print(parallel.load_spec({'backend': 'deepspeed'}).backend)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "deepspeed"
    lazy = subprocess.run([sys.executable, "-c", "import sys, parallel.cli.main, parallel.registry, "
                           "parallel.launch.torchrun; print('deepspeed' in sys.modules, 'torch_xla' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert lazy.stdout.split() == ["False", "False"], lazy.stderr  # imported only on demand


def test_validate_cli_without_optional_backends(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("backend: xla_fsdp\nshard: full\n")
    out = run(f"from parallel.cli.main import main; raise SystemExit(main(['validate', '{cfg}']))")
    assert out.returncode == 0, out.stderr
    assert "backend: xla_fsdp" in out.stdout
