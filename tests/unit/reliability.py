"""Figures the reliability tests produce, collected into docs/reliability.md at the end of the run
(tests/conftest.py). Each test records what it injected and what survived."""

import json
import os
from pathlib import Path

STORE = Path(os.environ.get("POLYSHARD_RELIABILITY_DIR", "/tmp/polyshard-reliability"))


def record(name: str, figures: dict) -> None:
    STORE.mkdir(parents=True, exist_ok=True)
    (STORE / f"{name}.json").write_text(json.dumps(figures, indent=1, default=str))
