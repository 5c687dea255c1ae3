from pathlib import Path

import yaml

from parallel import load_spec
from parallel.specdoc import reference

ROOT = Path(__file__).resolve().parents[2]


def test_readme_spec_reference_is_generated_from_the_models():
    assert reference() in (ROOT / "README.md").read_text(), (
        "README's spec reference is stale: python -m parallel.specdoc README.md")


def test_readme_opens_with_the_two_commands():
    head = (ROOT / "README.md").read_text().split("```")[1]
    assert "make demo" in head and "make test" in head


def test_every_config_validates():
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        assert load_spec(path).backend, path
        assert isinstance(yaml.safe_load(path.read_text()), dict)
