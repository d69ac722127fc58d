"""The rank script of ``tests/test_framework_edges.py``, run on 2 gloo processes; plain pytest
never collects it."""

collect_ignore_glob = ["*.py"]
