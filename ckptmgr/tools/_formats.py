"""The two export formats, written tensor by tensor so that no state dict exists in memory.

- safetensors: :func:`safetensors_header`, then each tensor's bytes in order.
- ``torch.save``'s zip layout (what ``torch.load(path, weights_only=True)`` reads): a
  ``data.pkl`` record written opcode by opcode (:func:`pt_data_pkl`), then one stored, 64-byte
  aligned record per tensor (:class:`PtWriter`).
"""

from __future__ import annotations

import json
import math
import pickle
import struct
import zipfile
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ckptmgr.dcp.metadata import dtype_name
from ckptmgr.errors import ConfigError
from ckptmgr.initial import PT_STORAGE_DTYPES, SAFETENSORS_DTYPES

__all__ = ["OutTensor", "PtWriter", "pt_data_pkl", "safetensors_header"]

# safetensors codes by torch dtype name, from the one table the reader uses (initial.py), so
# that whatever export writes, load_initial reads.
_SAFETENSORS_DTYPES = {dtype_name(dt): code for code, dt in SAFETENSORS_DTYPES.items()}
# torch.save names a storage by its legacy class where one exists (the reader's table, so the
# two agree); a dtype without one is stored as bytes (UntypedStorage) and named in the record.
_PT_STORAGE_TYPES = {dtype_name(dt): name for name, dt in PT_STORAGE_DTYPES.items()}

class OutTensor(Protocol):
    """One tensor as it goes into the output file."""

    @property
    def key(self) -> str:
        """Its flat key in the checkpoint (named in errors)."""

    @property
    def name(self) -> str:
        """Its name in the output file."""

    @property
    def shape(self) -> tuple[int, ...]:
        """Its shape."""

    @property
    def out_dtype(self) -> torch.dtype:
        """Its dtype in the output file."""

    @property
    def out_nbytes(self) -> int:
        """Its bytes in the output file."""


def safetensors_header(planned: Sequence[OutTensor], step: int) -> bytes:
    """The length-prefixed JSON header of a safetensors file holding ``planned`` in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "ckptmgr_step": str(step)}}
    pos = 0
    for t in planned:
        if t.name == "__metadata__":  # the header's own entry: a tensor there would replace it
            raise ConfigError(f"{t.key!r} would be named '__metadata__', which safetensors "
                              "reserves; rename it (key_map) or choose another prefix")
        code = _SAFETENSORS_DTYPES.get(dtype_name(t.out_dtype))
        if code is None:
            raise ConfigError(f"{t.key!r} has dtype {dtype_name(t.out_dtype)}, which safetensors "
                              "cannot store; export to .pt instead")
        header[t.name] = {"dtype": code, "shape": list(t.shape),
                          "data_offsets": [pos, pos + t.out_nbytes]}
        pos += t.out_nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _pickle_int(n: int) -> bytes:
    if 0 <= n < 256:
        return pickle.BININT1 + bytes([n])
    if -(2**31) <= n < 2**31:
        return pickle.BININT + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return pickle.LONG1 + bytes([len(raw)]) + raw


def _pickle_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _pickle_tuple(items: Sequence[int]) -> bytes:
    return pickle.MARK + b"".join(_pickle_int(i) for i in items) + pickle.TUPLE


def pt_data_pkl(planned: Sequence[OutTensor]) -> bytes:
    """The ``data.pkl`` record torch.save writes for a dict of contiguous CPU tensors.

    Written opcode by opcode (protocol 2, as torch.save) so that no tensor has to exist in memory:
    ``{name: _rebuild_tensor_v2(<storage key i>, 0, shape, stride, False, OrderedDict())}`` with
    persistent ids ``("storage", torch.<Type>Storage, "<i>", "cpu", numel)``; for a dtype
    without a legacy storage class (float8, uint16, ...), as torch.save does:
    ``_rebuild_tensor_v3(<storage>, 0, shape, stride, False, OrderedDict(), torch.<dtype>)``
    with ``("storage", torch.storage.UntypedStorage, "<i>", "cpu", nbytes)``.
    """
    out = [pickle.PROTO + b"\x02", pickle.EMPTY_DICT, pickle.MARK]
    for i, t in enumerate(planned):
        shape = t.shape
        stride = [0] * len(shape)
        acc = 1
        for d in range(len(shape) - 1, -1, -1):
            stride[d] = acc
            acc *= shape[d]
        dname = dtype_name(t.out_dtype)
        legacy = _PT_STORAGE_TYPES.get(dname)
        if legacy is not None:
            rebuild, storage, count, tail = (b"_rebuild_tensor_v2", f"torch\n{legacy}\n",
                                             math.prod(shape), [])
        else:
            rebuild, storage, count = (b"_rebuild_tensor_v3", "torch.storage\nUntypedStorage\n",
                                       t.out_nbytes)
            tail = [pickle.GLOBAL + f"torch\n{dname}\n".encode("ascii")]
        out += [
            _pickle_str(t.name),
            pickle.GLOBAL + b"torch._utils\n" + rebuild + b"\n",
            pickle.MARK,
            pickle.MARK, _pickle_str("storage"),
            pickle.GLOBAL + storage.encode("ascii"),
            _pickle_str(str(i)), _pickle_str("cpu"), _pickle_int(count), pickle.TUPLE,
            pickle.BINPERSID,
            _pickle_int(0), _pickle_tuple(shape), _pickle_tuple(stride), pickle.NEWFALSE,
            pickle.GLOBAL + b"collections\nOrderedDict\n", pickle.EMPTY_TUPLE, pickle.REDUCE,
            *tail, pickle.TUPLE, pickle.REDUCE,
        ]
    out += [pickle.SETITEMS, pickle.STOP]
    return b"".join(out)


class PtWriter:
    """Writes torch.save's zip layout record by record (stored, tensor data 64-byte aligned)."""

    _ALIGN = 64
    _ZIP64_LIMIT = (1 << 31) - 1

    def __init__(self, f: Any, archive: str) -> None:
        self.f = f
        self.archive = archive
        self.zf = zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True)

    def _info(self, name: str, size: int, *, align: bool) -> zipfile.ZipInfo:
        info = zipfile.ZipInfo(f"{self.archive}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        if align:
            # Pad the local header's extra field (id "FB", as torch does) so data starts aligned.
            zip64 = size * 1.05 > self._ZIP64_LIMIT
            base = self.f.tell() + 30 + len(info.filename.encode("utf-8")) + (20 if zip64 else 0)
            pad = -base % self._ALIGN
            if 0 < pad < 4:
                pad += self._ALIGN
            if pad:
                info.extra = struct.pack("<HH", 0x4246, pad - 4) + b"\0" * (pad - 4)
        return info

    def record(self, name: str, data: bytes) -> None:
        self.zf.writestr(self._info(name, len(data), align=False), data)

    def tensor_record(self, name: str, size: int) -> Any:
        return self.zf.open(self._info(name, size, align=True), "w")

    def close(self) -> None:
        self.zf.close()
