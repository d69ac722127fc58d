"""The README's framework sections run as written, each block in a fresh namespace: "Use from
PyTorch", "Use from JAX", "Run on JAX devices" and "Prove your framework's backward" (blocks
marked ``# needs: torch`` or ``# needs: jax``; skipped, with the reason, when that framework is
not installed). A block that sets ``XLA_FLAGS`` (JAX host devices, read when JAX is imported)
runs in its own process, under a timeout."""

import subprocess
import sys

import pytest
from test_readme import NEEDS_MARK, README, python_blocks

BLOCKS = [(NEEDS_MARK.match(block).group(1), block) for block in python_blocks() if NEEDS_MARK.match(block)]


def test_readme_has_the_framework_sections():
    text = README.read_text()
    for heading in (
        "## Use from PyTorch",
        "## Use from JAX",
        "## Run on JAX devices",
        "## Prove your framework's backward",
    ):
        assert heading in text
    assert sorted(need for need, _ in BLOCKS) == ["jax", "jax"] + ["torch"] * 5


@pytest.mark.parametrize("need, block", BLOCKS, ids=[f"{need}-{i}" for i, (need, _) in enumerate(BLOCKS)])
def test_readme_framework_block_runs(need, block, capsys):
    pytest.importorskip(
        need, reason=f"{need} is not installed (the {need} extra: pip install -e '.[{need}]')"
    )
    if "XLA_FLAGS" in block:  # JAX host devices: a fresh process, JAX not yet imported
        done = subprocess.run(
            [sys.executable, "-c", block],
            capture_output=True,
            text=True,
            timeout=600,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        printed = done.stdout
    else:
        exec(compile(block, str(README), "exec"), {})
        printed = capsys.readouterr().out
    if "jax_sharded" in block:
        assert "[('x', (20, 55))]" in printed
        assert "tensor 'z': dimension 0 is cut into 1 parts but mesh axis 'd' has 4 devices" in printed
    if "prove_backward" in block:
        assert "Proof(proven: Lifted[F.pad reflect]" in printed
        assert "row x0[0], column x1[3]: 1 versus 0" in printed
