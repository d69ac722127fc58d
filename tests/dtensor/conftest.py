"""Scripts run on several gloo processes by ``tests/test_dtensor.py`` (``spawn.py K`` runs
``checks.py`` on K processes). A plain pytest run does not collect them: the launcher sets
``LINOP_DTENSOR_TESTS=1`` (and nothing here is a pytest test even then)."""

import os

if os.environ.get("LINOP_DTENSOR_TESTS") != "1":
    collect_ignore_glob = ["*.py"]
else:
    collect_ignore_glob = ["spawn.py", "checks.py", "cases.py"]
