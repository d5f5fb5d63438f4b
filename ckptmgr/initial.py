"""Starting a run from weights saved elsewhere: a Hugging Face directory, a ``.safetensors`` file,
a ``torch.save`` file or another ckptmgr root (``CheckpointManager.load_initial``).

What a source is, by what ``source`` names:
- a local directory with ``model.safetensors.index.json`` (the Hugging Face layout), or
  ``model.safetensors``, or ``pytorch_model.bin[.index.json]``, or some ``*.safetensors`` files;
- a local ``.safetensors`` file (read by our own parser: no pickle, tensor by tensor);
- a local ``.pt``/``.pth``/``.bin`` file, read with ``torch.load(weights_only=True, mmap=True)``
  (nested dicts are flattened with ``.``);
- anything else is a ckptmgr root (local or any fsspec URL): its newest committed step is read
  through our DCP reader, resharding exactly as ``restore`` does. A step written by plain DCP
  (pickle metadata) is refused: ``ckptmgr import --trusted`` it first.

Names: a source tensor named ``n`` goes into the flat key ``key_map(n)`` of the state (a callable
returning None drops it; a dict maps the names it holds and keeps the others). Without
``key_map``, ``n`` goes into the flat key ``n``; when no name matches that way and one top-level
key ``p`` of the state makes ``p.n`` match (the usual ``{"model": model}`` wrapper), ``p.n`` is
used. Only tensors are loaded. Keys of the state that the source lacks stay as they are (logged);
a shape mismatch or a source that matches nothing is :class:`StateMismatchError`. File sources are
cast to the target's dtype; a ckptmgr root must match dtypes as ``restore`` requires.

Ranks: every rank calls :func:`load_initial` (the caller agrees on the outcome). File sources are
read whole on each rank, one tensor at a time, and each rank copies the slices its DTensors hold;
a ckptmgr root is loaded collectively.

Files are untrusted bytes: only regular files are opened (symbolic links followed, as the Hugging
Face hub cache needs; a FIFO or device is refused, never waited on); an index may name only plain
file names in its directory; every number of a safetensors header is checked against the file
before anything is allocated; a zip ``torch.save`` file's storages are checked against their
records before it is memory-mapped. A malformed file is :class:`ConfigError` naming it.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import pickle
import pickletools
import stat
import struct
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptmgr._dist import Comm
from ckptmgr._redact import redact
from ckptmgr.dcp.checkpoint import (
    PreparedRestore,
    RestoreSource,
    load_step,
    prepare_restore,
    read_restore_source,
)
from ckptmgr.dcp.state import FlatState, flatten_state
from ckptmgr.dcp.tensor_bytes import tensor_memoryview
from ckptmgr.errors import (
    ConfigError,
    StateMismatchError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptmgr.step_store import StepStore
from ckptmgr.storage import open_storage

__all__ = ["KeyMap", "load_initial"]

log = logging.getLogger("ckptmgr")

KeyMap = Callable[[str], "str | None"] | Mapping[str, str]

# The one table of safetensors dtype codes: this reader and the exporter (tools/_formats.py, a
# higher layer, which derives its codes from it) must agree on every name.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "U16": torch.uint16, "U32": torch.uint32,
    "U64": torch.uint64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "C64": torch.complex64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
# torch.save's legacy storage classes, by the name its pickles give them (data.pkl names a
# dtype without one as an UntypedStorage of bytes): this reader and the exporter's .pt writer
# (tools/_formats.py) both use this table.
PT_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "ComplexFloatStorage": torch.complex64,
    "ComplexDoubleStorage": torch.complex128,
}
_ITEMSIZE_OF = {dt: torch.empty((), dtype=dt).element_size()
                for dt in [*SAFETENSORS_DTYPES.values(), *PT_STORAGE_DTYPES.values()]}
_ITEMSIZE = {code: _ITEMSIZE_OF[dt] for code, dt in SAFETENSORS_DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
_MAX_INDEX = 100 * 1024 * 1024  # an index file (a few MB for the largest models)
_INT64_MAX = 2**63 - 1
_MAX_NDIM = 64  # far above any model; bounds the work per shape before its product is formed
_PT_SUFFIXES = (".pt", ".pth", ".bin")
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default (zip) format; anything else is legacy
_MAX_PICKLE = 256 * 1024 * 1024  # a data.pkl (a few MB for the largest models)
_MEMO_PUTS = ("PUT", "BINPUT", "LONG_BINPUT")


@dataclass
class _SourceTensor:
    """One tensor of a file source, read only when asked."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]


def _open_regular(path: str, what: str) -> io.BufferedReader:
    """Open ``path`` for reading if it is a regular file, without ever blocking.

    Symbolic links are followed (the Hugging Face hub cache links every file of a snapshot to
    ``../../blobs/``); what they lead to must be a regular file. The open is non-blocking, so a
    FIFO or a device is refused by ``fstat`` instead of waiting for a writer that never comes.

    Raises:
        ConfigError: ``path`` is missing, unreadable, or not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as e:
        raise ConfigError(f"{what} {path!r} does not exist") from e
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        raise ConfigError(f"cannot open {what} {path!r}: {getattr(e, 'strerror', None) or e}"
                          ) from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise ConfigError(f"{what} {path!r} is {kind}; ckptmgr reads weights from regular "
                              "files only")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_exact(f: io.BufferedReader, path: str, buf: memoryview | bytearray, what: str) -> None:
    try:
        got = f.readinto(buf)
    except OSError as e:
        raise StorageError(f"reading {what} of {path!r} failed: {e.strerror or e}") from e
    if got != len(buf):
        raise ConfigError(f"{path} is truncated in {what} ({got} of {len(buf)} bytes); "
                          "copy the file again")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict; a name given twice is an error (json keeps the last silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the name {_short(k)} appears twice")
        out[k] = v
    return out


def _parse_json(raw: bytes, path: str, what: str) -> Any:
    """The JSON document ``raw`` (UTF-8, no repeated keys), or ConfigError naming ``path``."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError too
        raise ConfigError(f"{path} is not a {what}: {e}") from e


def _count(value: Any) -> int | None:
    """``value`` if it is a non-negative JSON integer (never a bool or a float), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _bounded_numel(shape: tuple[int, ...], limit: int) -> int | None:
    """The element count of ``shape``, or None when the product of its non-zero sizes exceeds
    ``limit`` (checked as it is formed, so it never grows past ``limit`` times one size)."""
    n = 1
    for s in shape:
        if s:
            n *= s
            if n > limit:
                return None
    return 0 if 0 in shape else n


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
    if not isinstance(raw_shape, list) or len(raw_shape) > _MAX_NDIM:
        raise bad(f"has shape {_short(raw_shape)}; a shape is a list of at most {_MAX_NDIM} "
                  "sizes")
    dims = [_count(s) for s in raw_shape]
    if any(d is None for d in dims):
        raise bad(f"has shape {_short(raw_shape)}; sizes must be non-negative integers")
    shape = tuple(d for d in dims if d is not None)
    offsets = entry.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise bad(f"has data_offsets {_short(offsets)}; expected [begin, end]")
    begin, end = _count(offsets[0]), _count(offsets[1])
    if begin is None or end is None or begin > end or end > data_len:
        raise bad(f"has data_offsets {_short(offsets)}, outside the {data_len} bytes of data "
                  "(0 <= begin <= end <= data size)")
    # torch sizes a tensor in int64 bytes, empty ones included: (2**62, 4, 0) overflows it.
    numel = _bounded_numel(shape, _INT64_MAX // _ITEMSIZE[code])
    if numel is None:
        raise bad(f"has shape {_short(raw_shape)}, too large for any tensor")
    if numel * _ITEMSIZE[code] != end - begin:
        raise bad(f"has {end - begin} bytes, its shape {list(shape)} of {code} needs "
                  f"{numel * _ITEMSIZE[code]}")
    return shape, code, begin, end


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _safetensors(path: str) -> list[_SourceTensor]:
    """The tensors of one safetensors file, each read from its offsets when asked.

    The header is checked whole before anything is read: its length, that it is one JSON object
    of tensors with known dtypes, non-negative sizes and offsets inside the data section, each
    tensor exactly the bytes its shape needs, and no two tensors sharing a byte.

    Raises:
        ConfigError: the file is not a valid safetensors file (the message says why).
    """
    with _open_regular(path, "safetensors file") as f:
        size = os.fstat(f.fileno()).st_size
        raw = bytearray(8)
        _read_exact(f, path, raw, "the header length")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or n > size - 8:
            raise ConfigError(f"{path} is not a safetensors file (header of {n} bytes in a file "
                              f"of {size} bytes)")
        text = bytearray(n)
        _read_exact(f, path, text, "the header")
    header = _parse_json(bytes(text), path, "safetensors file")
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
    out: list[_SourceTensor] = []
    for name, shape, code, begin, _ in entries:
        dtype = SAFETENSORS_DTYPES[code]

        def read(begin: int = begin, shape: tuple[int, ...] = shape, dtype: torch.dtype = dtype,
                 name: str = name) -> torch.Tensor:
            buf = torch.empty(shape, dtype=dtype)  # bounded: the header checks tied it to the file
            view = tensor_memoryview(buf)
            with _open_regular(path, "safetensors file") as f:
                f.seek(base + begin)
                _read_exact(f, path, view, f"the bytes of {name!r}")
            return buf

        out.append(_SourceTensor(name, shape, dtype, read))
    return out


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
            return _StorageKind(_ITEMSIZE_OF[PT_STORAGE_DTYPES[name]])
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
        raise bad(f"{type(e).__name__}: {_short(str(e))}") from e
    scan = _StorageScan(data)
    try:
        _check_pickle_bounds(data)
        scan.load()
    except Exception as e:  # any malformed pickle; torch.load would refuse it too
        raise bad(f"its data.pkl does not parse ({type(e).__name__}: {_short(str(e))})") from e
    for pid in scan.pids:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")
                and isinstance(pid[1], _StorageKind) and isinstance(pid[2], str)
                and _count(pid[4]) is not None):
            raise bad(f"a storage is described as {_short(pid)}")
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


def _torch_file(path: str) -> list[_SourceTensor]:
    """The tensors of a ``torch.save`` file (weights only; the zip format memory-mapped).

    Raises:
        ConfigError: not a regular file, or not a ``torch.save`` file of weights (anything
            ``torch.load(weights_only=True)`` refuses or fails on, named with its reason).
    """
    with _open_regular(path, "torch.save file") as f:
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
    return [_SourceTensor(k, tuple(v.shape), v.dtype, _constant(v)) for k, v in flat.items()]


def _constant(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


def _index_files(index: str, path: str) -> list[str]:
    """The shard files a Hugging Face index names, each a plain file name inside ``path``.

    Raises:
        ConfigError: the index is not a JSON object whose ``weight_map`` maps names to names.
        UnsafeCheckpointError: a shard name is not a plain file name (a path, ``.`` or ``..``).
    """
    with _open_regular(index, "index file") as f:
        raw = f.read(_MAX_INDEX + 1)
    if len(raw) > _MAX_INDEX:
        raise ConfigError(f"{index} is larger than {_MAX_INDEX} bytes; not a Hugging Face index")
    doc = _parse_json(raw, index, "Hugging Face index (JSON)")
    weight_map = doc.get("weight_map", {}) if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"{index} is not a Hugging Face index: expected a JSON object whose "
                          "'weight_map' maps tensor names to file names")
    files = sorted(set(weight_map.values()))
    for name in files:
        if (name in ("", ".", "..") or "\0" in name or os.path.basename(name) != name
                or (os.altsep is not None and os.altsep in name)):
            raise UnsafeCheckpointError(f"{index} names {name!r}, which is not a file name "
                                        f"inside {path}")
    return files


def _read_all(path: str, files: list[str], reader: Callable[[str], list[_SourceTensor]],
              ) -> list[_SourceTensor]:
    """The tensors of ``files`` in ``path``; a name in two files is ambiguous, so an error."""
    out: list[_SourceTensor] = []
    where: dict[str, str] = {}
    for name in files:
        for t in reader(os.path.join(path, name)):
            if t.name in where:
                raise ConfigError(f"{path}: tensor {t.name!r} is in both {where[t.name]} and "
                                  f"{name}; remove one")
            where[t.name] = name
            out.append(t)
    return out


def _directory(path: str) -> list[_SourceTensor]:
    """The tensors of a Hugging Face model directory."""
    for index_name, reader in (("model.safetensors.index.json", _safetensors),
                               ("pytorch_model.bin.index.json", _torch_file)):
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            return _read_all(path, _index_files(index, path), reader)
    for single, reader in (("model.safetensors", _safetensors),
                           ("pytorch_model.bin", _torch_file)):
        if os.path.isfile(os.path.join(path, single)):
            return reader(os.path.join(path, single))
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    return _read_all(path, files, _safetensors)


def _is_file_source(path: str) -> bool:
    if os.path.exists(path) and not os.path.isdir(path) and path.endswith(
            (".safetensors", *_PT_SUFFIXES)):
        return True  # a weights file, or a FIFO or device so named: refused when opened
    return os.path.isfile(path) or (os.path.isdir(path) and any(
        f.endswith((".safetensors", ".index.json")) or f == "pytorch_model.bin"
        for f in os.listdir(path)))


def _file_source(path: str) -> list[_SourceTensor]:
    if os.path.isdir(path):
        tensors = _directory(path)
    elif path.endswith(".safetensors"):
        tensors = _safetensors(path)
    elif path.endswith(_PT_SUFFIXES):
        tensors = _torch_file(path)
    else:
        raise ConfigError(f"source {path!r} must be a .safetensors, .pt, .pth or .bin file, a "
                          "Hugging Face directory or a ckptmgr root")
    if not tensors:
        raise ConfigError(f"source {path!r} holds no tensors")
    return tensors


def _match(names: list[str], targets: Mapping[str, Any], key_map: KeyMap | None,
           ) -> dict[str, str]:
    """source name -> flat key of the state."""
    if key_map is not None:
        out: dict[str, str] = {}
        for n in names:
            t = key_map.get(n, n) if isinstance(key_map, Mapping) else key_map(n)
            if t is not None:
                out[n] = t
        return out
    direct = {n: n for n in names if n in targets}
    if direct:
        return direct
    best: dict[str, str] = {}
    for p in sorted({k.split(".", 1)[0] for k in targets}):
        found = {n: f"{p}.{n}" for n in names if f"{p}.{n}" in targets}
        if len(found) > len(best):
            best = found
    return best


def _copy_into(target: Any, src: torch.Tensor, key: str) -> None:
    """Copy the part of the global tensor ``src`` that ``target`` holds (all of it, or a
    DTensor's local shard), casting to the target's dtype."""
    to_local = getattr(target, "to_local", None)
    if to_local is None:
        with torch.no_grad():
            target.copy_(src)
        return
    local = to_local()
    chunks = list(target.__create_chunk_list__())
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise ConfigError(f"{key!r}: a DTensor with {len(chunks)} local regions; load_initial "
                          "copies one region per rank (shard or replicate on each mesh axis)")
    part = src
    for dim, (o, s) in enumerate(zip(chunks[0].offsets, chunks[0].sizes, strict=True)):
        part = part.narrow(dim, int(o), int(s))
    with torch.no_grad():
        local.copy_(part)


def _load_files(path: str, state_dict: Mapping[str, Any], key_map: KeyMap | None) -> int:
    tensors = {t.name: t for t in _file_source(path)}
    fs = flatten_state(state_dict)
    targets = {k: fs.flat[k] for k in fs.tensor_keys()}
    pairs = _match(list(tensors), targets, key_map)
    unknown = sorted(t for t in pairs.values() if t not in targets)
    pairs = {n: t for n, t in pairs.items() if t in targets}
    _check_pairs(path, pairs, targets, unknown)
    bad = [f"{t}: source {list(tensors[n].shape)}, state {list(targets[t].shape)}"
           for n, t in pairs.items() if tuple(tensors[n].shape) != tuple(targets[t].shape)]
    if bad:
        raise StateMismatchError(f"{len(bad)} shapes differ between {path} and the state: "
                                 f"{bad[:10]}", step=None, missing=[], mismatches=bad)
    nbytes = 0
    for n, t in pairs.items():
        src = tensors[n].read()  # one source tensor in memory at a time
        _copy_into(targets[t], src, t)
        nbytes += src.numel() * src.element_size()
        del src
    fs.apply_values({})  # load_state_dict on every Stateful, with its now-filled state dict
    return nbytes


def _check_pairs(source: str, pairs: Mapping[str, str], targets: Mapping[str, Any],
                 unknown: list[str]) -> None:
    if not pairs:
        hint = (f"the key map gives keys the state lacks, e.g. {unknown[:5]}" if unknown
                else "pass key_map to rename")
        raise StateMismatchError(
            f"nothing in {source} matches the state's tensors (e.g. {sorted(targets)[:5]}); "
            f"{hint}", step=None, missing=sorted(targets), mismatches=[])
    if unknown:
        log.warning("load_initial: %d names mapped to keys the state lacks, left out: %s",
                    len(unknown), unknown[:10])
    left = sorted(set(targets) - set(pairs.values()))
    if left:
        log.warning("load_initial: %d tensors of the state are not in %s and stay as they are: "
                    "%s", len(left), source, left[:10])


def _read_root(url: str, storage_options: Mapping[str, Any] | None, verify: bool,
               ) -> tuple[int, RestoreSource]:
    """(coordinator) The newest committed step of root ``url``, its manifest and metadata."""
    store = StepStore(open_storage(url, storage_options, writable=False))
    scan = store.scan()
    if not scan.committed:
        if scan.dcp_steps:
            raise UnsafeCheckpointError(
                f"{store.url} holds only steps written by plain DCP (pickle metadata): run "
                "`ckptmgr import --trusted` into a root first")
        raise ConfigError(f"source {store.url} is neither a weights file, a Hugging Face "
                          "directory nor a ckptmgr root with a committed step")
    step = scan.committed[-1]
    return step, read_restore_source(store, step, verify=verify)


def _prepare_root(url: str, step: int, src: RestoreSource, state_dict: Mapping[str, Any],
                  key_map: KeyMap | None, world_size: int,
                  ) -> tuple[PreparedRestore, FlatState]:
    """(every rank) Match the step's names with the state and check shapes and dtypes."""
    fs = flatten_state(state_dict)
    targets = {k: fs.flat[k] for k in fs.tensor_keys()}
    pairs = _match(list(src.metadata.state_dict_metadata), targets, key_map)
    unknown = sorted(t for t in pairs.values() if t not in targets)
    pairs = {n: t for n, t in pairs.items() if t in targets}
    _check_pairs(f"{redact(url)} step {step}", pairs, targets, unknown)
    renamed = {n: targets[t] for n, t in pairs.items()}  # source names -> the state's tensors
    prepared = prepare_restore(src, step, renamed, planner="auto", allow_partial=True,
                               trusted=False, world_size=world_size)
    return prepared, fs


def load_initial(source: str | os.PathLike[str], state_dict: Mapping[str, Any], *,
                 key_map: KeyMap | None, comm: Comm,
                 storage_options: Mapping[str, Any] | None = None, verify: bool = True) -> int:
    """(every rank of ``comm``) Load ``source``'s tensors into ``state_dict`` in place; the
    bytes read on this rank. See the module docstring for sources and names.

    Raises:
        StateMismatchError: nothing matches, or shapes differ (ckptmgr roots: dtypes too).
        ConfigError: an unreadable, malformed or unknown source, or not a regular file.
        UnsafeCheckpointError: a plain-DCP source (pickle), or an index naming anything but a
            plain file name in its directory.
        CorruptCheckpointError, StorageError: as ``restore``, for a ckptmgr root; StorageError
            also when reading a local file fails midway.
    """
    if key_map is not None and not (callable(key_map) or isinstance(key_map, Mapping)):
        raise ConfigError(f"key_map must be a callable or a dict, got {type(key_map).__name__}")
    path = os.fspath(source)
    if _is_file_source(path):
        return comm.agree(lambda: _load_files(path, state_dict, key_map))
    # A root is loaded collectively, once every rank has checked it against its state.
    step, src = comm.on_coordinator(lambda: _read_root(path, storage_options, verify))
    prepared, fs = comm.agree(lambda: _prepare_root(path, step, src, state_dict, key_map,
                                                    comm.world_size), token=step)
    store = StepStore(open_storage(path, storage_options, writable=False))
    nbytes = load_step(prepared, store, step, rank=comm.rank, world_size=comm.world_size,
                       group=comm.group, verify=verify, trusted=False)
    fs.apply_values({})  # load_state_dict on every Stateful, with its now-filled state dict
    log.info("load_initial: loaded step %d of %s", step, store.url)
    return nbytes

