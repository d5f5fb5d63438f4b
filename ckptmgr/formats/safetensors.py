"""The safetensors format, both directions: the reader of ``load_initial`` (our own parser: no
pickle, tensor by tensor, every number of the header checked against the file) and the writer of
``ckptmgr export`` (:func:`safetensors_header`, then each tensor's bytes in order). One dtype
table serves both, so whatever export writes, ``load_initial`` reads.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from collections.abc import Sequence
from typing import Any

import torch

from ckptmgr.dcp.metadata import dtype_name
from ckptmgr.dcp.tensor_bytes import tensor_memoryview
from ckptmgr.errors import ConfigError
from ckptmgr.formats.files import (
    INT64_MAX,
    MAX_NDIM,
    OutTensor,
    SourceTensor,
    bounded_numel,
    nonneg_int,
    open_regular,
    parse_json,
    read_exact,
    short_repr,
)

__all__ = ["SAFETENSORS_DTYPES", "read_safetensors", "safetensors_header"]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "U16": torch.uint16, "U32": torch.uint32,
    "U64": torch.uint64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "C64": torch.complex64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
"""The one table of safetensors dtype codes, read by the reader and inverted by the writer."""
_CODES = {dt: code for code, dt in SAFETENSORS_DTYPES.items()}
_ITEMSIZE = {code: dt.itemsize for code, dt in SAFETENSORS_DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


def _st_entry(path: str, name: str, entry: Any, data_len: int,
              ) -> tuple[tuple[int, ...], str, int, int]:
    """(shape, dtype code, begin, end) of one header entry, every number checked: the bytes lie
    inside the data section and are exactly what the shape and dtype need."""
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{path} is not a valid safetensors file: tensor {name!r} {why}")

    if not isinstance(entry, dict):
        raise bad(f"is described by a {type(entry).__name__}, not an object")
    code = entry.get("dtype")
    if not isinstance(code, str) or code not in SAFETENSORS_DTYPES:
        raise ConfigError(f"{path}: {name!r} has dtype {code!r}, which ckptmgr cannot read "
                          f"(known: {sorted(SAFETENSORS_DTYPES)})")
    raw_shape = entry.get("shape")
    if not isinstance(raw_shape, list) or len(raw_shape) > MAX_NDIM:
        raise bad(f"has shape {short_repr(raw_shape)}; a shape is a list of at most {MAX_NDIM} "
                  "sizes")
    dims = [nonneg_int(s) for s in raw_shape]
    if any(d is None for d in dims):
        raise bad(f"has shape {short_repr(raw_shape)}; sizes must be non-negative integers")
    shape = tuple(d for d in dims if d is not None)
    offsets = entry.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise bad(f"has data_offsets {short_repr(offsets)}; expected [begin, end]")
    begin, end = nonneg_int(offsets[0]), nonneg_int(offsets[1])
    if begin is None or end is None or begin > end or end > data_len:
        raise bad(f"has data_offsets {short_repr(offsets)}, outside the {data_len} bytes of data "
                  "(0 <= begin <= end <= data size)")
    # torch sizes a tensor in int64 bytes, empty ones included: (2**62, 4, 0) overflows it.
    numel = bounded_numel(shape, INT64_MAX // _ITEMSIZE[code])
    if numel is None:
        raise bad(f"has shape {short_repr(raw_shape)}, too large for any tensor")
    if numel * _ITEMSIZE[code] != end - begin:
        raise bad(f"has {end - begin} bytes, its shape {list(shape)} of {code} needs "
                  f"{numel * _ITEMSIZE[code]}")
    return shape, code, begin, end


def read_safetensors(path: str) -> list[SourceTensor]:
    """The tensors of one safetensors file, each read from its offsets when asked.

    The header is checked whole before anything is read: its length, that it is one JSON object
    of tensors with known dtypes, non-negative sizes and offsets inside the data section, each
    tensor exactly the bytes its shape needs, and no two tensors sharing a byte.

    Raises:
        ConfigError: the file is not a valid safetensors file (the message says why).
    """
    with open_regular(path, "safetensors file") as f:
        size = os.fstat(f.fileno()).st_size
        raw = bytearray(8)
        read_exact(f, path, raw, "the header length")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or n > size - 8:
            raise ConfigError(f"{path} is not a safetensors file (header of {n} bytes in a file "
                              f"of {size} bytes)")
        text = bytearray(n)
        read_exact(f, path, text, "the header")
    header = parse_json(bytes(text), path, "safetensors file")
    if not isinstance(header, dict):
        raise ConfigError(f"{path} is not a safetensors file: its header is a "
                          f"{type(header).__name__}, not a JSON object")
    base = 8 + n
    data_len = size - base
    entries = [(name, *_st_entry(path, name, entry, data_len))
               for name, entry in header.items() if name != "__metadata__"]
    # Two tensors sharing bytes would alias each other's values: refuse (safetensors does too).
    spans = sorted((b, e, name) for name, _, _, b, e in entries if e > b)
    for (_, e1, n1), (b2, _, n2) in itertools.pairwise(spans):
        if b2 < e1:
            raise ConfigError(f"{path} is not a valid safetensors file: the bytes of {n1!r} and "
                              f"{n2!r} overlap")
    out: list[SourceTensor] = []
    for name, shape, code, begin, _ in entries:
        dtype = SAFETENSORS_DTYPES[code]

        def read(begin: int = begin, shape: tuple[int, ...] = shape, dtype: torch.dtype = dtype,
                 name: str = name) -> torch.Tensor:
            buf = torch.empty(shape, dtype=dtype)  # bounded: the header checks tied it to the file
            view = tensor_memoryview(buf)
            with open_regular(path, "safetensors file") as f:
                f.seek(base + begin)
                read_exact(f, path, view, f"the bytes of {name!r}")
            return buf

        out.append(SourceTensor(name, shape, dtype, read))
    return out


def safetensors_header(planned: Sequence[OutTensor], step: int) -> bytes:
    """The length-prefixed JSON header of a safetensors file holding ``planned`` in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "ckptmgr_step": str(step)}}
    pos = 0
    for t in planned:
        if t.name == "__metadata__":  # the header's own entry: a tensor there would replace it
            raise ConfigError(f"{t.key!r} would be named '__metadata__', which safetensors "
                              "reserves; rename it (key_map) or choose another prefix")
        code = _CODES.get(t.out_dtype)
        if code is None:
            raise ConfigError(f"{t.key!r} has dtype {dtype_name(t.out_dtype)}, which safetensors "
                              "cannot store; export to .pt instead")
        header[t.name] = {"dtype": code, "shape": list(t.shape),
                          "data_offsets": [pos, pos + t.out_nbytes]}
        pos += t.out_nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw
