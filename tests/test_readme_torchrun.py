"""The README's "Run under torchrun" script: a block whose first line is ``# torchrun: K``. It
is run as written under ``python -m torch.distributed.run --nproc-per-node K`` by
``tests/test_torch_distributed.py`` (in the launch that runs the executor's checks on K
processes, so the suite pays for one launch); here: that it exists and is found."""

from test_readme import README, TORCHRUN_MARK, python_blocks


def torchrun_block() -> tuple[int, str]:
    """The process count and the code of the README's one torchrun block."""
    ((count, block),) = [
        (int(TORCHRUN_MARK.match(b).group(1)), b) for b in python_blocks() if TORCHRUN_MARK.match(b)
    ]
    return count, block


def test_readme_has_one_torchrun_block():
    assert "## Run under torchrun" in README.read_text()
    count, block = torchrun_block()
    assert count >= 2 and "group=True" in block and "LayerModule" in block
