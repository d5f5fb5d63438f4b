"""The dtypes the byte formats name, by torch's name for each (pure: no torch, no numpy)."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["DTYPE_CANONICAL", "DTYPE_ITEMSIZE"]

DTYPE_ITEMSIZE: Mapping[str, int] = {
    "bfloat16": 2, "bit": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1,
    "bool": 1, "cdouble": 16, "cfloat": 8, "chalf": 4, "complex128": 16, "complex32": 4,
    "complex64": 8, "double": 8, "float": 4, "float16": 2, "float32": 4, "float4_e2m1fn_x2": 1,
    "float64": 8, "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "half": 2, "int": 4, "int1": 1, "int16": 2,
    "int2": 1, "int3": 1, "int32": 4, "int4": 1, "int5": 1, "int6": 1, "int64": 8, "int7": 1,
    "int8": 1, "long": 8, "qint32": 4, "qint8": 1, "quint2x4": 1, "quint4x2": 1, "quint8": 1,
    "short": 2, "uint1": 1, "uint16": 2, "uint2": 1, "uint3": 1, "uint32": 4, "uint4": 1,
    "uint5": 1, "uint6": 1, "uint64": 8, "uint7": 1, "uint8": 1,
}
"""Bytes per element of every dtype the format names, by torch's name for it (``torch.<name>``,
aliases included). A name outside this table is an unknown dtype; the table holds every dtype of
the torch this ckptmgr is tested with (a test compares them)."""

DTYPE_CANONICAL: Mapping[str, str] = {
    "bit": "uint1", "cdouble": "complex128", "cfloat": "complex64", "chalf": "complex32",
    "double": "float64", "float": "float32", "half": "float16", "int": "int32", "long": "int64",
    "short": "int16",
}
"""Torch's own name (``str(torch.<alias>)``) of each alias in :data:`DTYPE_ITEMSIZE`: a decoded
dtype is named as torch names it, so ``ckptmgr inspect`` shows ``float32`` for a file that says
``float``, as it did when it read dtypes through torch (a test compares them)."""
