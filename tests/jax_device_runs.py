"""One JAX device check (a script of ``tests/jax_devices/``) in a subprocess of 4 host devices
(``XLA_FLAGS``), with ``jax_enable_x64`` on or off: the launcher of the tests that prove the
lowering on devices."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def run_device_check(
    script: str, counts: tuple[int, ...], x64: bool = False
) -> subprocess.CompletedProcess[str]:
    """``tests/jax_devices/<script>`` for the device ``counts`` (each a mesh of that many of the
    process's 4 host devices), its output captured; skipped without jax."""
    pytest.importorskip("jax", reason="jax is not installed (the jax extra: pip install -e '.[jax]')")
    environment = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    environment["JAX_ENABLE_X64"] = "1" if x64 else "0"
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parent), str(HERE), str(HERE / "jax_devices"), environment.get("PYTHONPATH", "")]
    )
    return subprocess.run(
        [sys.executable, str(HERE / "jax_devices" / script), "4", *map(str, counts)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=environment,
        stdin=subprocess.DEVNULL,
    )
