"""Python values in a state dict as tagged JSON, so restoring never needs pickle.

Plain JSON covers None, bool, int, str, finite floats, lists and str-keyed dicts. Tags keep the
rest exact: ``{"__tuple__": [...]}``, ``{"__float__": "nan" | "inf" | "-inf"}``,
``{"__bytes__": "<base64>"}``, ``{"__dict__": [[key, value], ...]}`` for dicts with non-str keys
(or keys that look like tags) and ``{"__odict__": [[key, value], ...]}`` for OrderedDicts.
Exact types only: a subclass (a namedtuple, an IntEnum) is not representable and needs pickle.
"""

from __future__ import annotations

import base64
import json
import math
from collections import OrderedDict
from typing import Any

__all__ = ["MAX_VALUE_BYTES", "NotRepresentableError", "decode_tagged", "decode_value",
           "encode_tagged", "encode_value", "is_representable"]

_TAGS = frozenset({"__tuple__", "__float__", "__bytes__", "__dict__", "__odict__"})
_MAX_DEPTH = 100
MAX_VALUE_BYTES = 256 << 20
"""The most bytes one stored Python value may take (tagged JSON, or pickle when trusted): saving a
larger one is refused, and a restore refuses a checkpoint that claims more before allocating.
Large data belongs in tensors."""


class NotRepresentableError(TypeError):
    """The value holds an object that tagged JSON cannot store exactly."""


def _enc(obj: Any, depth: int, allow_bytes: bool = True) -> Any:
    if depth > _MAX_DEPTH:
        raise NotRepresentableError(f"value is nested deeper than {_MAX_DEPTH} levels")
    t = type(obj)
    if obj is None or t is bool or t is int or t is str:
        return obj
    if t is float:
        if math.isfinite(obj):
            return obj
        return {"__float__": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if t is list:
        return [_enc(v, depth + 1, allow_bytes) for v in obj]
    if t is tuple:
        return {"__tuple__": [_enc(v, depth + 1, allow_bytes) for v in obj]}
    if t is bytes:
        if not allow_bytes:
            raise NotRepresentableError("bytes are stored with pickle here")
        return {"__bytes__": base64.b64encode(obj).decode("ascii")}
    if t is OrderedDict:
        return {"__odict__": _pairs(obj, depth, allow_bytes)}
    if t is dict:
        if all(type(k) is str for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
            return {k: _enc(v, depth + 1, allow_bytes) for k, v in obj.items()}
        return {"__dict__": _pairs(obj, depth, allow_bytes)}
    raise NotRepresentableError(f"{t.__module__}.{t.__qualname__} is not a plain Python value")


def _pairs(obj: dict[Any, Any], depth: int, allow_bytes: bool) -> list[list[Any]]:
    return [[_enc(k, depth + 1, allow_bytes), _enc(v, depth + 1, allow_bytes)]
            for k, v in obj.items()]


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        raise ValueError("a dict key decoded to a list")
    return key


def _payload(tag: str, payload: Any, typ: type) -> Any:
    if not isinstance(payload, typ):
        raise ValueError(f"{tag} holds {type(payload).__name__}, not {typ.__name__}")
    return payload


def _pairs_of(tag: str, payload: Any, depth: int) -> list[tuple[Any, Any]]:
    out = []
    for pair in _payload(tag, payload, list):
        if not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"{tag} holds {pair!r:.100}, not a [key, value] pair")
        out.append((_hashable(_dec(pair[0], depth + 1)), _dec(pair[1], depth + 1)))
    return out


def _dec(obj: Any, depth: int = 0) -> Any:
    # Every shape a tag's payload may have is checked here, so that a crafted value fails with
    # ValueError (wrapped by the callers), never with whatever a wrong type happens to raise.
    # Depth counts as _enc counts it (a tag and its payload are one level), so every value that
    # encodes decodes.
    if depth > _MAX_DEPTH:
        raise ValueError(f"value is nested deeper than {_MAX_DEPTH} levels")
    if isinstance(obj, list):
        return [_dec(v, depth + 1) for v in obj]
    if isinstance(obj, dict):
        if len(obj) == 1:
            (tag, payload), = obj.items()
            if tag == "__tuple__":
                return tuple(_dec(v, depth + 1) for v in _payload(tag, payload, list))
            if tag == "__float__":
                if payload not in ("nan", "inf", "-inf"):
                    raise ValueError(f"bad __float__ payload {payload!r:.100}")
                return float(payload)
            if tag == "__bytes__":
                return base64.b64decode(_payload(tag, payload, str).encode("ascii"),
                                        validate=True)
            if tag == "__dict__":
                return dict(_pairs_of(tag, payload, depth))
            if tag == "__odict__":
                return OrderedDict(_pairs_of(tag, payload, depth))
        return {k: _dec(v, depth + 1) for k, v in obj.items()}
    return obj


def is_representable(obj: Any, *, allow_bytes: bool = True) -> bool:
    """Whether ``obj`` round-trips exactly through :func:`encode_value`."""
    try:
        _enc(obj, 0, allow_bytes)
    except NotRepresentableError:
        return False
    return True


def encode_tagged(obj: Any, *, allow_bytes: bool = True) -> Any:
    """``obj`` as a tagged JSON document (plain dicts, lists, str, numbers), not yet serialized:
    for embedding a value in a larger JSON document.

    Raises:
        NotRepresentableError: ``obj`` holds something other than plain Python values (or, with
            ``allow_bytes=False``, holds ``bytes``).
    """
    return _enc(obj, 0, allow_bytes)


def decode_tagged(doc: Any) -> Any:
    """The value :func:`encode_tagged` made ``doc`` from (``doc`` already parsed from JSON).

    Raises:
        ValueError: ``doc`` is not a tagged JSON document.
    """
    try:
        return _dec(doc)
    except (TypeError, ValueError, AttributeError, RecursionError) as e:
        raise ValueError(f"not a tagged JSON value: {e}"[:300]) from e


def encode_value(obj: Any, *, allow_bytes: bool = True) -> bytes:
    """``obj`` as tagged JSON bytes.

    Args:
        allow_bytes: store ``bytes`` with the ``__bytes__`` tag (else they are not representable:
            the standalone DCP writer keeps them for pickle, as plain DCP does).

    Raises:
        NotRepresentableError: ``obj`` holds something other than plain Python values.
    """
    return json.dumps(_enc(obj, 0, allow_bytes), separators=(",", ":"),
                      allow_nan=False).encode("utf-8")


def decode_value(data: bytes) -> Any:
    """The value :func:`encode_value` encoded.

    Raises:
        ValueError: the bytes are not tagged JSON written by us.
    """
    try:
        # No depth pre-scan: json's C parser counts its nesting against the recursion limit
        # (RecursionError, never a C stack overflow) and _dec bounds the depth itself, so a
        # value of MAX_VALUE_BYTES decodes at C speed. ValueError covers bad UTF-8, bad JSON,
        # and ints of over 4300 digits.
        return _dec(json.loads(data.decode("utf-8")))
    except (TypeError, ValueError, AttributeError, RecursionError) as e:
        raise ValueError(f"not a tagged JSON value: {e}"[:300]) from e
