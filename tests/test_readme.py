"""The README's API tour runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_an_api_tour():
    assert len(python_blocks()) >= 2


def test_readme_python_blocks_run_in_order(capsys):
    namespace: dict = {}
    for block in python_blocks():
        exec(compile(block, str(README), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "C*[a -> b] = K[b] @ S[b -> a]" in printed
    assert "2 * SR[a[0:2] -> b[2:4]] @ C[a -> b] - K[a]" in printed
    assert "source shape (2,) differs from destination shape (4,)" in printed
    assert "block 'c' is missing on the left" in printed
