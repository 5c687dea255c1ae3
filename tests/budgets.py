"""What the two conftests share about the suite's time budgets (tests/conftest.py enforces them):
where the shared launches (tests/distributed/shared.py) record their seconds."""

import pytest

# (the file whose test started the shared launches, their seconds)
SHARED_SECONDS = pytest.StashKey[tuple]()
SHARED = "tests/distributed/(shared launches)"  # their line in the table, with a budget of its own
SHARED_BUDGET_S = 1100.0
