"""Tagged JSON for Python values: exact round trips, refusals, hostile input."""

from __future__ import annotations

import math
from collections import OrderedDict, namedtuple
from typing import Any

import pytest

from ckptmgr.codec.values import NotRepresentableError, decode_value, encode_value, is_representable

P = namedtuple("P", "x y")


@pytest.mark.parametrize("value", [
    None, True, False, 0, -(2**100), 1.5, -0.0, 1e308, 5e-324, "", "ü\u2603", b"", b"\x00\xff",
    [], [1, [2, [3]]], (), (1,), ((1, 2), [3, (4,)]), {}, {"a": 1}, {1: "x", 2: (None,)},
    {(1, 2): "tuple key"}, {None: 1, True: 2, 1.5: 3}, {"__tuple__": [1]}, {"__float__": "nan"},
    OrderedDict([("b", 1), ("a", 2)]), {"k": {"__dict__": 1}},
])
def test_round_trip_exact(value: Any) -> None:
    out = decode_value(encode_value(value))
    assert out == value and type(out) is type(value)
    assert repr(out) == repr(value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_floats(value: float) -> None:
    out = decode_value(encode_value(value))
    assert type(out) is float
    assert (math.isnan(out) and math.isnan(value)) or out == value


@pytest.mark.parametrize("value", [object(), P(1, 2), {1, 2}, bytearray(b"x"), [1, object()],
                                   {"a": complex(1, 2)}])
def test_not_representable(value: Any) -> None:
    assert not is_representable(value)
    with pytest.raises(NotRepresentableError):
        encode_value(value)


def test_too_deep() -> None:
    v: Any = 1
    for _ in range(150):
        v = [v]
    assert not is_representable(v)
    with pytest.raises(ValueError):
        decode_value(b"[" * 100_000 + b"]" * 100_000)


@pytest.mark.parametrize("data", [b"{", b"\xff\xfe", b'{"__float__": "zero"}',
                                  b'{"__bytes__": "!!"}', b'{"__dict__": [[[1], 2]]}'])
def test_malformed(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_value(data)
