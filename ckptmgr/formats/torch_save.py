"""The ``torch.save`` format, both directions: the reader of ``load_initial`` (weights only:
``torch.load(weights_only=True)``, the zip format memory-mapped after its storages were checked
against their records) and the writer of ``ckptmgr export --format pt`` (torch.save's zip layout,
what ``torch.load(path, weights_only=True)`` reads: a ``data.pkl`` record written opcode by
opcode (:func:`pt_data_pkl`), then one stored, 64-byte aligned record per tensor
(:class:`PtWriter`), so that no state dict exists in memory). One table of torch.save's legacy
storage classes serves both.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import struct
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptmgr.dcp.metadata import dtype_name
from ckptmgr.errors import ConfigError
from ckptmgr.formats.files import (
    OutTensor,
    SourceTensor,
    nonneg_int,
    open_regular,
    short_repr,
)

__all__ = ["PT_STORAGE_DTYPES", "PtWriter", "pt_data_pkl", "read_torch_file"]

PT_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}
"""torch.save's legacy storage classes, by the name its pickles give them (data.pkl names a
dtype without one as an UntypedStorage of bytes): the reader's and the writer's one table."""
_STORAGE_NAMES = {dt: name for name, dt in PT_STORAGE_DTYPES.items()}
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default (zip) format; anything else is legacy
_MAX_PICKLE = 256 * 1024 * 1024  # a data.pkl (a few MB for the largest models)
_MEMO_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")


def _flatten_loaded(value: Any, out: dict[str, torch.Tensor]) -> None:
    """Tensors of nested mappings under dotted names (iterative: a deeply nested file must not
    exhaust the interpreter's stack)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        prefix, v = stack.pop()
        if isinstance(v, torch.Tensor):
            out[prefix] = v
        elif isinstance(v, Mapping):
            # Reversed onto the stack so the file's order is kept.
            stack.extend((f"{prefix}.{k}" if prefix else str(k), x)
                         for k, x in reversed(list(v.items())))


class _Opaque:
    """Whatever a weights pickle builds, in the structural pass of :func:`_check_zip_records`:
    accepts every call and update and does nothing (no global is ever imported or run)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Opaque:
        return _Opaque()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


@dataclass(frozen=True)
class _StorageKind:
    itemsize: int


class _StorageScan(pickle.Unpickler):
    """Collects the persistent ids (storages) of a ``data.pkl`` without building anything."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.pids: list[Any] = []

    def find_class(self, module: str, name: str) -> Any:
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            return _StorageKind(1)
        if module == "torch" and name in PT_STORAGE_DTYPES:
            return _StorageKind(PT_STORAGE_DTYPES[name].itemsize)
        return _Opaque

    def persistent_load(self, pid: Any) -> Any:
        self.pids.append(pid)
        return _Opaque()


def _check_pickle_bounds(data: bytes) -> None:
    """Walk ``data``'s opcodes without running them: every counted length must fit in ``data``
    (pickletools checks) and every memo index must be one the pickle could have made so far.

    The C unpickler sizes its memo table by the largest index it is given and zeroes it, so a
    16-byte pickle asking for index 2**31 costs tens of GB; and it allocates a counted string's
    claimed length before reading it.

    Raises:
        ValueError: the pickle is malformed or claims more than it holds.
    """
    for n, (op, arg, pos) in enumerate(pickletools.genops(data), start=1):
        if op.name in _MEMO_PUTS and not (isinstance(arg, int) and 0 <= arg < n):
            raise ValueError(f"memo index {arg!r} at byte {pos} after {n} opcodes")


def _check_zip_records(path: str, f: io.BufferedReader) -> None:
    """Check that every storage a zip-format ``torch.save`` file's ``data.pkl`` names is a stored
    record of exactly its bytes.

    ``torch.load(mmap=True)`` slices each storage from the mapped file at its record's start with
    the length the pickle claims, unchecked (without mmap it checks): a claim longer than the
    record would read the next records' zip headers as weights.

    Raises:
        ConfigError: the archive is malformed, or a storage's bytes are not its record's.
    """
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{path} is not a torch.save file of weights: {why}")

    try:
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
            records = {i.filename: i for i in infos}
            if len(records) != len(infos):
                raise bad("the archive names a record twice")
            pkls = [i for i in infos if i.filename.endswith("/data.pkl")]
            if len(pkls) != 1:
                raise bad(f"expected one data.pkl record, found {len(pkls)}")
            prefix = pkls[0].filename[: -len("data.pkl")]
            if not all(i.filename.startswith(prefix) for i in infos):
                raise bad("its records are not all in one archive directory")
            if pkls[0].file_size > _MAX_PICKLE:
                raise bad(f"its data.pkl has {pkls[0].file_size} bytes")
            data = z.read(pkls[0])
    except ConfigError:
        raise
    except Exception as e:  # zipfile raises BadZipFile, ValueError, OSError, ... on bad bytes
        raise bad(f"{type(e).__name__}: {short_repr(str(e))}") from e
    scan = _StorageScan(data)
    try:
        _check_pickle_bounds(data)
        scan.load()
    except Exception as e:  # any malformed pickle; torch.load would refuse it too
        raise bad(f"its data.pkl does not parse ({type(e).__name__}: {short_repr(str(e))})") from e
    for pid in scan.pids:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")
                and isinstance(pid[1], _StorageKind) and isinstance(pid[2], str)
                and nonneg_int(pid[4]) is not None):
            raise bad(f"a storage is described as {short_repr(pid)}")
        info = records.get(f"{prefix}data/{pid[2]}")
        need = pid[4] * pid[1].itemsize
        if info is None:
            raise bad(f"storage {pid[2]!r} has no record")
        if (info.compress_type != zipfile.ZIP_STORED or info.file_size != need
                or info.compress_size != need):
            raise bad(f"storage {pid[2]!r} needs {need} bytes, its record holds "
                      f"{info.compress_size} (stored: {info.compress_type == zipfile.ZIP_STORED})")


def _reason(e: Exception) -> str:
    """The informative line of a torch.load error (weights-only errors start with advice)."""
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    for s in lines:
        if "WeightsUnpickler error" in s:
            return s[:200]
    return lines[0][:200] if lines else ""


def read_torch_file(path: str) -> list[SourceTensor]:
    """The tensors of a ``torch.save`` file (weights only; the zip format memory-mapped).

    Raises:
        ConfigError: not a regular file, or not a ``torch.save`` file of weights (anything
            ``torch.load(weights_only=True)`` refuses or fails on, named with its reason).
    """
    with open_regular(path, "torch.save file") as f:
        is_zip = f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
        f.seek(0)
        if is_zip:
            _check_zip_records(path, f)
            f.seek(0)
        try:
            if is_zip:
                # mmap needs a path; the file was just checked to be a regular one.
                loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            else:  # the legacy format cannot be memory-mapped: read from the checked file
                loaded = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch.load raises whatever its parsers meet on bad bytes
            raise ConfigError(f"{path} is not a torch.save file of weights: "
                              f"{type(e).__name__}: {_reason(e)}") from e
    flat: dict[str, torch.Tensor] = {}
    _flatten_loaded(loaded, flat)
    for k, v in flat.items():
        if v.layout != torch.strided or v.device.type != "cpu" or v.is_quantized:
            raise ConfigError(f"{path}: {k!r} is a {v.layout} tensor on {v.device}"
                              f"{' (quantized)' if v.is_quantized else ''}; load_initial reads "
                              "dense CPU tensors only")
    return [SourceTensor(k, tuple(v.shape), v.dtype, _constant(v)) for k, v in flat.items()]


def _constant(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


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
        legacy = _STORAGE_NAMES.get(t.out_dtype)
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
