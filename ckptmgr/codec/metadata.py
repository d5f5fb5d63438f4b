"""Decoded DCP metadata, torch-free: the plain structures both metadata formats decode into.

A :class:`MetadataDoc` holds what loading needs: per key, tensor dtype, global size and stored
chunks (:mod:`ckptmgr.codec.chunks`), or a marker for an encoded Python value; and per stored
item, where its bytes are (:class:`ItemLocation`: file, offset, length, checksum, encoding).
Format 1 (:mod:`.metadata_json`) lists the locations in a dict; format 2
(:mod:`.metadata_columnar`) keeps them as columns (:class:`ColumnarStorage`) and makes a
location only when asked. :mod:`ckptmgr.codec.metadata_file` reads and writes the file in
either format; :mod:`ckptmgr.dcp.metadata` turns a document into DCP's ``Metadata`` (and back,
for writing), and ``ckptmgr inspect``/``verify`` read it without torch.

The field readers at the end are the checks both formats share (dtype, sizes, planner data, the
JSON document and its version).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptmgr.codec.chunks import INT64_END, Boxes, BoxTable, Column, GridBoxes
from ckptmgr.codec.dtypes import DTYPE_CANONICAL, DTYPE_ITEMSIZE
from ckptmgr.codec.manifest import ManifestError, check_json_depth
from ckptmgr.codec.values import NotRepresentableError, decode_tagged, encode_tagged

__all__ = [
    "ENCODINGS", "FORMAT", "VALUE_ENCODINGS", "ColumnarStorage", "ItemLocation", "MetadataDoc",
    "StorageKey", "TensorEntry", "TensorLocations", "decode_planner_paths",
    "encode_planner_paths", "load_document", "read_dtype", "read_ints", "read_size",
]

ENCODINGS = ("raw", "json", "pickle")
# A Python value is tagged JSON, or pickle (read only when trusted); a reader that took any other
# encoding for a value would have to guess, and must never guess pickle.
VALUE_ENCODINGS = ("json", "pickle")
FORMAT = "ckptmgr-dcp-metadata"
# Larger metadata skips the depth pre-scan, which runs byte by byte in Python above 1 MiB (about
# 0.1 s per MiB: most of the decode time of a 16k-rank step); the parser bounds the depth itself.
_DEPTH_PRESCAN_BYTES = 1 << 20

StorageKey = tuple[str, "tuple[int, ...] | None"]
"""Which stored item: the key, and a tensor chunk's offsets (None for a Python value)."""



@dataclass(frozen=True)
class ItemLocation:
    """Where one stored item's bytes are, inside the step directory."""

    file: str
    offset: int
    length: int
    checksum: str
    enc: str  # "raw" tensor bytes, "json" tagged JSON value, "pickle" torch.save bytes


@dataclass(frozen=True)
class TensorLocations:
    """Where each chunk of one tensor is stored: file index (into the files table), position,
    and the checksum's 64 bits (written as ``prefix`` + 16 hex digits); the length is the chunk's
    elements times ``itemsize``."""

    chunks: GridBoxes | BoxTable
    itemsize: int
    file: Column
    pos: Column
    checksum: Column
    prefix: str

    def location(self, files: Sequence[str], i: int) -> ItemLocation:
        """The location of chunk ``i``."""
        c = self.chunks
        if isinstance(c, GridBoxes):
            if c.size:
                d = c.dim
                n = c.rows(i) * math.prod([s for j, s in enumerate(c.size) if j != d])
            else:
                n = 1
        else:
            n = math.prod(c.box(i)[1])
        bits = self.checksum[i] & ((1 << 64) - 1)
        return ItemLocation(files[self.file[i]], self.pos[i], n * self.itemsize,
                            f"{self.prefix}{bits:016x}", "raw")


class ColumnarStorage:
    """The locations of format-2 metadata: made on lookup from per-tensor columns (tensor
    chunks) or taken from a small dict (values, by key)."""

    def __init__(self, files: Sequence[str], tensors: Mapping[str, TensorLocations],
                 values: Mapping[str, ItemLocation]) -> None:
        self.files = tuple(files)
        self.tensors = dict(tensors)
        self.values = dict(values)

    def get(self, fqn: str, offsets: Sequence[int] | None,
            hint: int | None = None) -> ItemLocation | None:
        """The location of value ``fqn`` (``offsets`` None) or of its chunk at ``offsets``."""
        if offsets is None:
            return self.values.get(fqn)
        t = self.tensors.get(fqn)
        if t is None:
            return None
        i = t.chunks.index_of(offsets, hint)
        return None if i is None else t.location(self.files, i)

    def entries(self) -> Iterator[tuple[str, tuple[int, ...] | None, int | None]]:
        """``(fqn, offsets, chunk index)`` of every stored item: tensor chunks, then values."""
        for fqn, t in self.tensors.items():
            for i in range(len(t.chunks)):
                yield fqn, t.chunks.box(i)[0], i
        for fqn in self.values:
            yield fqn, None, None

    def __len__(self) -> int:
        return len(self.values) + sum(len(t.chunks) for t in self.tensors.values())

    def __reduce__(self) -> tuple[Any, ...]:
        return (ColumnarStorage, (self.files, self.tensors, self.values))

    def __repr__(self) -> str:
        return (f"ColumnarStorage({len(self.tensors)} tensors, "
                f"{len(self.values)} values, {len(self.files)} files)")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the checkpoint: dtype (torch's name), global size, stored chunks."""

    dtype: str
    size: tuple[int, ...]
    chunks: Boxes


@dataclass
class MetadataDoc:
    """Decoded metadata, torch-free.

    Attributes:
        tensors: key -> :class:`TensorEntry`.
        values: the keys of Python values (stored as tagged JSON or pickle).
        storage: where each item is: a :class:`ColumnarStorage` (format 2), a dict from
            :data:`StorageKey` to :class:`ItemLocation` (format 1), or None (no locations).
        planner_data: each flat key's path in the nested state dict, or None.
        dcp_version: DCP's metadata version string, or None.
    """

    tensors: dict[str, TensorEntry]
    values: list[str]
    storage: ColumnarStorage | dict[StorageKey, ItemLocation] | None
    planner_data: dict[str, tuple[str | int, ...]] | None = None
    dcp_version: str | None = None

    def location(self, fqn: str, offsets: Sequence[int] | None) -> ItemLocation | None:
        """Where value ``fqn`` (``offsets`` None) or its chunk at ``offsets`` is stored."""
        s = self.storage
        if s is None:
            return None
        if isinstance(s, ColumnarStorage):
            return s.get(fqn, offsets)
        return s.get((fqn, None if offsets is None else tuple(offsets)))

    def locations(self) -> Iterator[tuple[str, tuple[int, ...] | None, ItemLocation]]:
        """Every stored item: ``(fqn, chunk offsets or None for a value, location)``."""
        s = self.storage
        if isinstance(s, ColumnarStorage):
            for fqn, t in s.tensors.items():
                for i in range(len(t.chunks)):
                    yield fqn, t.chunks.box(i)[0], t.location(s.files, i)
            for fqn, loc in s.values.items():
                yield fqn, None, loc
        elif s is not None:
            for (fqn, offsets), loc in s.items():
                yield fqn, offsets, loc


# ---------------------------------------------------------------------------------------------
# Fields both formats read the same way.


def read_dtype(name: Any) -> str:
    """A dtype name of the format (:data:`~ckptmgr.codec.dtypes.DTYPE_ITEMSIZE`), as torch
    names it (an alias such as ``float`` becomes ``float32``)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ManifestError(f"bad dtype {name!r}")
    if name not in DTYPE_ITEMSIZE:
        raise ManifestError(f"unknown dtype {name!r}")
    return DTYPE_CANONICAL.get(name, name)


def read_ints(v: Any, what: str) -> list[int]:
    """A list of ints in [0, 2**63) (``what``: the field, for messages)."""
    if not isinstance(v, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < INT64_END for x in v):
        raise ManifestError(f"{what} must be a list of ints >= 0 (and below 2**63), got {v!r}"
                            [:300])
    return v


def read_size(v: Any, fqn: str) -> tuple[int, ...]:
    """A tensor's global size: ints >= 0 whose product (zeros counted as 1, so that no product
    of some of them overflows either) fits int64, as every tensor's does."""
    size = tuple(read_ints(v, f"{fqn}.size"))
    if math.prod(max(d, 1) for d in size) >= INT64_END:
        raise ManifestError(f"size {list(size)} of {fqn!r} holds more elements than a tensor can"
                            [:300])
    return size


def encode_planner_paths(planner_data: Any) -> Any:
    """``planner_data`` as tagged JSON when it is DCP's flattening map (flat key -> path of str
    and int parts), else None (not stored)."""
    if not isinstance(planner_data, dict) or not planner_data:
        return None
    for k, path in planner_data.items():
        if not isinstance(k, str) or not isinstance(path, (tuple, list)) or not all(
                type(p) in (str, int) for p in path):
            return None
    try:
        return encode_tagged({k: tuple(p) for k, p in planner_data.items()})
    except NotRepresentableError:
        return None


def decode_planner_paths(doc: Any) -> dict[str, tuple[str | int, ...]]:
    """The stored ``planner_data`` (:func:`encode_planner_paths`), checked."""
    try:
        paths = decode_tagged(doc)
    except ValueError as e:
        raise ManifestError(f"bad planner_data: {e}") from e
    if not isinstance(paths, dict):
        raise ManifestError("planner_data must map keys to paths")
    out: dict[str, tuple[str | int, ...]] = {}
    for k, path in paths.items():
        if not isinstance(k, str) or not isinstance(path, tuple) or not path or not all(
                type(p) in (str, int) for p in path):
            raise ManifestError(f"bad planner_data path for {k!r}")
        out[k] = path
    return out


def load_document(raw: bytes, version: int, what: str) -> dict[str, Any]:
    """The JSON object ``raw`` (``what``: "metadata" or "metadata header", for messages), nesting
    bounded, of our format and ``version``."""
    if len(raw) <= _DEPTH_PRESCAN_BYTES:
        check_json_depth(raw, 16)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except RecursionError as e:
        # json's C parser counts its nesting against the recursion limit (it never overflows
        # the C stack), so a deep document fails here; the schema rejects the rest.
        raise ManifestError("metadata JSON is nested too deeply") from e
    except ValueError as e:  # also UnicodeDecodeError, and ints of over 4300 digits
        raise ManifestError(f"{what} is not valid JSON: {e}"[:300]) from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError("not ckptmgr DCP metadata")
    if doc.get("version") != version:
        raise ManifestError(f"metadata version {doc.get('version')!r} is not supported by this "
                            "ckptmgr (it reads versions 1 and 2): upgrade ckptmgr")
    return doc
