"""The fuzz campaign on the JAX lowering, in one process of 4 host devices:
``python jax_lowering.py EXAMPLES [SEED]`` (run by ``tests/test_fuzz_engines.py`` with
``JAX_ENABLE_X64`` 0 or 1, bounded by a timeout). It draws calls of
:func:`verify.strategies_malformed_launched.jax_cases` on 2 and 4 devices and prints their
outcomes (:mod:`report`)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# the flags this process was given (the suite's: tests/conftest.py), then its host devices
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
from hypothesis import strategies as st
from report import emit

from verify.strategies_malformed_engines import campaign
from verify.strategies_malformed_launched import jax_cases

if __name__ == "__main__":
    examples = int(sys.argv[1])
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else None
    mode = "x64" if jax.config.jax_enable_x64 else "x32"
    start = time.perf_counter()
    outcomes = campaign(st.one_of(jax_cases(2), jax_cases(4)), examples, seed=seed)
    print(f"CPU: {time.process_time():.2f} s", flush=True)
    emit(f"JAX {mode}", outcomes, time.perf_counter() - start)
