"""``repr`` reproduces the constructor call, ``str`` stays mathematical."""

import pytest

from linop import Add, Block, Clear, Copy, Move, Scaled, SendRecv, Space

SPACE = Space([Block("a", (4,), worker=0), Block("b", (4,), worker=1)])
A, B = SPACE["a"], SPACE["b"]
NAMES = {"Add": Add, "Clear": Clear, "Copy": Copy, "Move": Move, "Scaled": Scaled, "SendRecv": SendRecv}
NAMES |= {"a": A, "b": B, "Block": Block}

CASES = {
    "copy": (Copy(A[0:2], B[2:4]), "Copy(src=a[0:2], dst=b[2:4])", "C[a[0:2] -> b[2:4]]"),
    "scaled": (2 * Copy(A, B), "Scaled(alpha=2, operator=Copy(src=a, dst=b))", "2 * C[a -> b]"),
    "clear": (Clear(A[1:3]), "Clear(region=a[1:3])", "K[a[1:3]]"),
    "send": (SendRecv(A, B), "SendRecv(src=a, dst=b)", "SR[a -> b]"),
    "move-new": (Move(B, "d"), "Move(src=b, dst=Block('d', (4,), worker=1))", "M[b -> new d]"),
}


@pytest.mark.parametrize(("op", "text", "math"), CASES.values(), ids=CASES.keys())
def test_repr_is_the_constructor_and_str_the_notation(op, text, math):
    assert repr(op) == text
    assert eval(repr(op), dict(NAMES)) == op
    assert str(op) == math
