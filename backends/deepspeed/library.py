"""DeepSpeed imported without what it imports for a feature polyshard never runs.

`import deepspeed` imports its autotuner, and the autotuner imports mlflow when mlflow is installed
(`try: import mlflow`, deepspeed/autotuning/autotuner.py), only to report autotuning runs. polyshard's
`tracking` extra installs mlflow, so every rank of every DeepSpeed job paid for it: `import deepspeed`
took 6.5-8.0 s on this 2-core host, 4.5-4.8 s without mlflow (three runs each, docs/deepspeed.md).
polyshard never runs DeepSpeed's autotuner. So the first import hides mlflow for its length, and the
autotuner records `has_mlflow = False`. Right after it, mlflow imports as before: an mlflow tracker
imports it when it starts. Where deepspeed was imported already (by the user's script, or
accelerate), nothing changes.
"""

from __future__ import annotations

import sys
from types import ModuleType


def import_deepspeed() -> ModuleType:
    """The deepspeed module, imported at most once per process, with mlflow hidden during that
    import where nothing has imported mlflow yet."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError meanwhile
    try:
        import deepspeed
    finally:
        if hide and sys.modules.get("mlflow", ModuleType("x")) is None:
            del sys.modules["mlflow"]
    return deepspeed
