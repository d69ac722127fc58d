"""The README's framework sections run as written, each block in a fresh namespace: "Use from
PyTorch", "Use from JAX" and "Prove your framework's backward" (blocks marked ``# needs: torch``
or ``# needs: jax``; skipped, with the reason, when that framework is not installed)."""

import pytest
from test_readme import NEEDS_MARK, README, python_blocks

BLOCKS = [(NEEDS_MARK.match(block).group(1), block) for block in python_blocks() if NEEDS_MARK.match(block)]


def test_readme_has_the_framework_sections():
    text = README.read_text()
    for heading in ("## Use from PyTorch", "## Use from JAX", "## Prove your framework's backward"):
        assert heading in text
    assert sorted(need for need, _ in BLOCKS) == ["jax", "torch", "torch", "torch"]


@pytest.mark.parametrize("need, block", BLOCKS, ids=[f"{need}-{i}" for i, (need, _) in enumerate(BLOCKS)])
def test_readme_framework_block_runs(need, block, capsys):
    pytest.importorskip(
        need, reason=f"{need} is not installed (the {need} extra: pip install -e '.[{need}]')"
    )
    exec(compile(block, str(README), "exec"), {})
    printed = capsys.readouterr().out
    if "prove_backward" in block:
        assert "Proof(proven: Lifted[F.pad reflect]" in printed
        assert "row x0[0], column x1[3]: 1 versus 0" in printed
