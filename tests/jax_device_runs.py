"""One JAX device check (a script of ``tests/jax_devices/``) in a subprocess of 4 host devices
(``XLA_FLAGS``), with ``jax_enable_x64`` on or off: the launcher of the tests that prove the
lowering on devices."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def host_devices(devices: int) -> str:
    """``XLA_FLAGS`` for a JAX process of ``devices`` host devices: this process's own flags
    (tests/conftest.py's ``XLA_TEST_FLAGS``) and the device count."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()


@functools.cache
def _cache_folder() -> str:
    folder = tempfile.mkdtemp(prefix="linop-jax-compilation-cache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def compilation_cache() -> dict[str, str]:
    """The environment of a JAX process that shares XLA's compilations with the other JAX
    processes this test process starts: JAX's persistent compilation cache in a folder of this
    test process (made on first use, removed when it exits), every compilation written to it.

    JAX keys an entry by the program's text (the StableHLO module), the compile options, the
    devices and the versions of jax, jaxlib and XLA, so a process reads back only the executable
    of a program identical to one compiled before, which XLA would compile again to the same
    executable: every lowering is still traced and emitted by linop afresh, and a wrong one (a
    control) is a different program. Used by processes that run one after another (the device
    processes of ``tests/test_jax_shard.py``: its ``jax_enable_x64`` process repeats many of the
    first process's programs, about 8 s of CPU); the test processes themselves (which count
    XLA's compilations in ``tests/test_jax_recompile.py``) do not use it."""
    return {
        "JAX_COMPILATION_CACHE_DIR": _cache_folder(),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def run_device_check(
    script: str, counts: tuple[int, ...], x64: bool = False
) -> subprocess.CompletedProcess[str]:
    """``tests/jax_devices/<script>`` for the device ``counts`` (each a mesh of that many of the
    process's 4 host devices), its output captured; skipped without jax."""
    pytest.importorskip("jax", reason="jax is not installed (the jax extra: pip install -e '.[jax]')")
    environment = dict(os.environ, XLA_FLAGS=host_devices(4))
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
