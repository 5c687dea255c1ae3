import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # harness.py

from budgets import SHARED_SECONDS  # noqa: E402
from shared import Shared  # noqa: E402


@pytest.fixture(scope="session")
def shared(request, tmp_path_factory):
    """Every collected module's `shared_jobs(tmp)`, run in one launch per phase and layout
    (shared.py); returns {module name: (its tmp, the Shared run)}. Its seconds are counted apart
    from the file whose test happened to start it (tests/conftest.py: "(shared launches)")."""
    start = time.perf_counter()
    run = Shared(tmp_path_factory.mktemp("shared"))
    modules = {item.module.__name__: item.module for item in request.session.items
               if hasattr(item, "module") and hasattr(item.module, "shared_jobs")}
    tmps, jobs = {}, []
    for name, module in sorted(modules.items()):
        tmps[name] = tmp_path_factory.mktemp(name)
        jobs += module.shared_jobs(tmps[name])
    run.run(jobs)
    item = getattr(request, "_pyfuncitem", None)
    request.config.stash[SHARED_SECONDS] = (item.nodeid.split("::")[0] if item else None,
                                            time.perf_counter() - start)
    launches = [(l['phase'], l['nproc'], len(l['jobs']), l['seconds']) for l in run.launches]
    print(f"\nshared launches: {launches}", file=sys.stderr)
    return {name: (tmp, run) for name, tmp in tmps.items()}
