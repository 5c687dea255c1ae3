from pathlib import Path

import yaml

from parallel import load_spec
from parallel.spec.doc import reference

ROOT = Path(__file__).resolve().parents[2]


def test_spec_reference_is_generated_from_the_models():
    assert reference() in (ROOT / "docs" / "spec.md").read_text(), (
        "docs/spec.md is stale: python -m parallel.spec.doc docs/spec.md")


def test_readme_stays_short():
    """README: the two commands, an example, the commands, what is guaranteed, the layout, the
    configs; the guarantees' figures and the references live in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_readme_opens_with_the_two_commands():
    head = (ROOT / "README.md").read_text().split("```")[1]
    assert "make demo" in head and "make test" in head


def test_every_config_validates():
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        assert load_spec(path).backend, path
        assert isinstance(yaml.safe_load(path.read_text()), dict)


def test_llama3_family_differs_only_in_backend():
    family = {p.name: yaml.safe_load(p.read_text()) for p in (ROOT / "configs").glob("llama3-8b-*")}
    assert {d["backend"] for d in family.values()} == {"fsdp", "deepspeed", "xla_fsdp"}
    stripped = [{k: v for k, v in d.items() if k != "backend"} for d in family.values()]
    assert all(s == stripped[0] for s in stripped)


def test_readme_lists_every_config():
    readme = (ROOT / "README.md").read_text()
    for path in (ROOT / "configs").glob("*.yaml"):
        assert f"`configs/{path.name}`" in readme, path.name


def test_docker_images_pin_what_constraints_pins_and_smoke_test_the_configs():
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    gpu = (ROOT / "docker" / "gpu.Dockerfile").read_text()
    assert f"'deepspeed=={pins['deepspeed']}'" in gpu and "-c constraints.txt" in gpu
    # the TPU image is the XLA lane's: torch 2.9 + torch_xla 2.9 (docs/lanes.md)
    assert "-c constraints-xla.txt" in (ROOT / "docker" / "tpu.Dockerfile").read_text()
    # TorchTPU's image is the main lane's, torch from the CPU index (docs/tpu.md)
    torchtpu = (ROOT / "docker" / "torchtpu.Dockerfile").read_text()
    assert "constraints.txt" in torchtpu and "'.[torchtpu,hf]'" in torchtpu
    for name in ("gpu", "tpu", "torchtpu"):
        text = (ROOT / "docker" / f"{name}.Dockerfile").read_text()
        assert 'polyshard validate "${config}"' in text and "COPY configs" in text


def test_every_repository_path_named_in_code_and_docs_exists():
    """Docstrings and docs that point at a module point at one that exists (files move)."""
    import re
    import subprocess

    root = Path(__file__).resolve().parents[2]
    files = subprocess.run(["git", "ls-files", "*.py", "*.md"], cwd=root, capture_output=True,
                           text=True, check=True).stdout.split()
    pattern = re.compile(r"\b(?:parallel|backends|benchmarks|tests|docs)/[A-Za-z0-9_/.-]+\.(?:py|md)\b")
    missing = sorted({f"{name}: {m}" for name in files if (root / name).is_file()
                      for m in pattern.findall((root / name).read_text(errors="replace"))
                      if not (root / m).exists()})
    assert not missing, "\n".join(missing)
