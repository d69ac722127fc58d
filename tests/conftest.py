"""Test-suite settings: hypothesis draws the same examples on every run (reproducible CI).

Set ``HYPOTHESIS_PROFILE=explore`` to draw fresh random examples (and more of them) instead.
"""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
