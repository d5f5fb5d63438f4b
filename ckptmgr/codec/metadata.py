"""The DCP metadata file as bytes and back, torch-free, so reading a checkpoint never runs pickle.

The encoding holds what loading needs: per key, tensor dtype, global size and stored chunks, or a
marker for an encoded Python value; and per stored item, where its bytes are (file, offset, length),
their checksum and encoding. :func:`parse_metadata` validates every field and every path and gives
a :class:`MetadataDoc` of plain structures; :mod:`ckptmgr.dcp.metadata` turns one into DCP's
``Metadata`` (and back, for writing), and ``ckptmgr inspect``/``verify`` read it without torch.

Two formats (docs/byte-format.md), both read by :func:`parse_metadata`:

- **format 2** (written since issue 18): a JSON header plus packed integer columns. Per tensor its
  chunks are one record when they split one dimension regularly (FSDP2's ``Shard(0)``: "N chunks
  of r rows, the last ones shorter") or one int64 column otherwise; storage locations (file,
  position, checksum) are columns too, each stored as a constant, an arithmetic run, runs of
  equal values or packed ints; lengths follow from the chunk sizes. Decoding is O(tensors) plus
  vectorised range checks of the packed columns, and gives lazy chunk sequences
  (:class:`GridBoxes`, :class:`BoxTable`) and lazy locations (:class:`ColumnarStorage`) that
  make a chunk or a location only when asked: at N ranks an FSDP2 checkpoint has N chunks per
  sharded tensor, and building them all costs O(ranks x tensors) Python objects (seconds at 16k
  ranks).
- **format 1**: one JSON document with an object per chunk and per stored item
  (O(ranks x tensors) objects); still written when the metadata does not fit format 2's model
  (a tensor item not stored raw, a checksum that is not ``<prefix><16 hex digits>``, a length
  other than the chunk's bytes).

Optional, when the save planner flattened a nested state dict (DCP's default planners do):
``planner_data``, each flat key's path in the nested dict (tagged JSON: str keys and int list
indices), which DCP's own tools use to rebuild nesting (``_EmptyStateDictLoadPlanner``,
``load_sharded_optimizer_state_dict``). A planner whose data is anything else keeps it to itself.

The vectorised checks use numpy (int64 arrays), never torch.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import sys
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptmgr.codec.dtypes import DTYPE_ITEMSIZE
from ckptmgr.codec.layout import check_file_name
from ckptmgr.codec.manifest import ManifestError, UnsafePathError, check_json_depth
from ckptmgr.codec.values import NotRepresentableError, decode_tagged, encode_tagged

__all__ = [
    "ENCODINGS", "MAGIC", "MAX_METADATA_BYTES", "VERSION", "VERSIONS", "Box",
    "BoxList", "BoxTable", "Boxes", "ColumnarStorage", "Column", "GridBoxes", "ItemLocation",
    "MetadataDoc", "StorageKey", "TensorEntry", "TensorLocations", "parse_metadata",
    "serialize_metadata",
]

ENCODINGS = ("raw", "json", "pickle")
# A Python value is tagged JSON, or pickle (read only when trusted); a reader that took any other
# encoding for a value would have to guess, and must never guess pickle.
_VALUE_ENCODINGS = ("json", "pickle")
FORMAT = "ckptmgr-dcp-metadata"
VERSION = 2
VERSIONS = (1, 2)
MAGIC = b"CKPTMDv2"  # format 2 starts with these 8 bytes, then the header length (u64 LE)
MAX_METADATA_BYTES = 1 << 30
_INT64 = 1 << 63  # every number in metadata is an int64 (format 2's columns are int64)
# A chunk table stored as a constant, an arithmetic run or runs of equal values is expanded to
# be checked: at most this many values each, and this many in all per file. The writer never
# comes near (such a table of chunks that tile a tensor exactly once holds a few chunks: two
# chunks that both lie inside one run have the same offsets); larger tables are packed, which
# the file's own bytes bound.
_MAX_TABLE_VALUES = 1 << 20
_MAX_EXPANDED_VALUES = 1 << 24
# Chunks in all per file (a grid states any number in a few bytes): more than the largest job
# writes (16k ranks x 16k tensors), so that counting them (len of storage_data) never overflows
# and iterating them costs no more than a genuine checkpoint's.
_MAX_CHUNKS = 1 << 28
# Checking an irregular N-d chunk layout costs (chunks x 2**dims split) corner points; beyond
# this many the layout is refused (no writer makes one: real layouts are grids of tiles).
_MAX_CORNERS = 1 << 26
# Larger metadata skips the depth pre-scan, which runs byte by byte in Python above 1 MiB (about
# 0.1 s per MiB: most of the decode time of a 16k-rank step); the parser bounds the depth itself.
_DEPTH_PRESCAN_BYTES = 1 << 20

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""One chunk: its offsets and its sizes, per dimension."""

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


# ---------------------------------------------------------------------------------------------
# Compact, lazily expanded chunk lists and locations (what format 2 decodes into).


class Column:
    """A read-only column of ``n`` int64 values: a constant, an arithmetic run, runs of equal
    values, or packed native-order int64 (read in place from a bytearray or a read-only buffer
    such as the metadata file's bytes)."""

    __slots__ = ("_view", "a", "b", "kind", "n")

    def __init__(self, n: int, kind: str, a: Any, b: Any = None) -> None:
        # kind "c": a = value; "a": a = start, b = step; "r": a = values, b = run ends
        # (cumulative, the last == n); "q": a = buffer, b = byte offset of the n values.
        self.n, self.kind, self.a, self.b = n, kind, a, b
        self._view: Any = None

    @classmethod
    def packed(cls, values: Sequence[int]) -> Column:
        """A packed column of ``values``."""
        return cls(len(values), "q", bytearray(array("q", values).tobytes()), 0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        k = self.kind
        if k == "c":
            return int(self.a)
        if k == "a":
            return int(self.a + i * self.b)
        if k == "r":
            return int(self.a[bisect.bisect_right(self.b, i)])
        if self._view is None:
            self._view = memoryview(self.a)[self.b:self.b + 8 * self.n].cast("q")
        return int(self._view[i])

    def to_array(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """All values as an int64 array (a read-only view of the bytes for a packed column)."""
        k = self.kind
        if k == "c":
            return np.full(self.n, int(self.a), dtype=np.int64)
        if k == "a":
            return int(self.a) + np.arange(self.n, dtype=np.int64) * int(self.b)
        if k == "r":
            ends = np.asarray(self.b, dtype=np.int64)
            counts = ends - np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1]])
            return np.repeat(np.asarray(self.a, dtype=np.int64), counts)
        if self.n == 0:
            return np.zeros(0, dtype=np.int64)
        return np.frombuffer(self.a, dtype=np.int64, count=self.n, offset=self.b)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.kind == "q" and not isinstance(self.a, bytearray):
            # A view of the metadata file's bytes: pickle only this column's.
            return (Column, (self.n, "q", bytearray(
                memoryview(self.a)[self.b:self.b + 8 * self.n]), 0))
        return (Column, (self.n, self.kind, self.a, self.b))


class Boxes:
    """The chunks of one tensor of ``size``, as a sequence of :data:`Box` made on demand."""

    size: tuple[int, ...]

    def __len__(self) -> int:
        raise NotImplementedError

    def box(self, i: int) -> Box:
        """Offsets and sizes of chunk ``i`` (0 <= i < len)."""
        raise NotImplementedError

    def index_of(self, offsets: Sequence[int], hint: int | None = None) -> int | None:
        """The index of the chunk at ``offsets``, or None (``hint``: where it likely is)."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[Box]:
        for i in range(len(self)):
            yield self.box(i)

    def volume(self) -> int:
        """Elements the chunks hold in total."""
        return sum(math.prod(s) for _, s in self)

    def overlapping(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Indices of the non-empty chunks that share an element with the box (``offsets``,
        ``sizes``)."""
        if math.prod(sizes) == 0:
            return []
        out = []
        for i, (co, cs) in enumerate(self):
            if math.prod(cs) and all(a < b + bs and b < a + as_ for a, as_, b, bs in zip(
                    offsets, sizes, co, cs, strict=True)):
                out.append(i)
        return out

    def same_boxes(self, other: Boxes) -> bool:
        """Whether ``other`` lists the same chunks in the same order."""
        return other is self or (len(self) == len(other) and all(
            self.box(i) == other.box(i) for i in range(len(self))))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} chunks of {list(self.size)})"


class BoxList(Boxes):
    """Chunks listed one by one (format 1, or metadata built in memory)."""

    def __init__(self, size: Sequence[int], boxes: Sequence[Box]) -> None:
        self.size = tuple(size)
        self.boxes = list(boxes)
        self._where: dict[tuple[int, ...], int] | None = None

    def __len__(self) -> int:
        return len(self.boxes)

    def box(self, i: int) -> Box:
        return self.boxes[i]

    def __iter__(self) -> Iterator[Box]:
        return iter(self.boxes)

    def index_of(self, offsets: Sequence[int], hint: int | None = None) -> int | None:
        key = tuple(offsets)
        if hint is not None and 0 <= hint < len(self.boxes) and self.boxes[hint][0] == key:
            return hint
        if self._where is None:
            where: dict[tuple[int, ...], int] = {}
            for i, (o, _) in enumerate(self.boxes):
                where.setdefault(o, i)
            self._where = where
        return self._where.get(key)

    def __reduce__(self) -> tuple[Any, ...]:
        return (BoxList, (self.size, self.boxes))


class GridBoxes(Boxes):
    """``count`` chunks splitting dimension ``dim`` of a tensor of ``size`` into runs of
    ``step`` (torch.chunk's rule, which FSDP2's ``Shard(0)`` follows): chunk i starts at
    ``min(i * step, size[dim])`` along ``dim`` (0 elsewhere) and spans
    ``min(step, size[dim] - i * step)`` of it, at least 0 (the whole of every other
    dimension); at most one chunk starts at the end (an empty one, as DCP's dedup keeps). A 0-d
    tensor has one chunk, its whole self."""

    def __init__(self, size: Sequence[int], dim: int, step: int, count: int) -> None:
        self.size = tuple(size)
        self.dim, self.step, self.num_chunks = dim, step, count

    def __len__(self) -> int:
        return self.num_chunks

    def box(self, i: int) -> Box:
        if not self.size:
            return (), ()
        d = self.dim
        start = min(i * self.step, self.size[d])
        offsets = [0] * len(self.size)
        offsets[d] = start
        sizes = list(self.size)
        sizes[d] = max(0, min(self.step, self.size[d] - start))
        return tuple(offsets), tuple(sizes)

    def rows(self, i: int) -> int:
        """Extent of chunk ``i`` along ``dim``."""
        if not self.size:
            return 1
        return max(0, min(self.step, self.size[self.dim] - i * self.step))

    def index_of(self, offsets: Sequence[int], hint: int | None = None) -> int | None:
        if len(offsets) != len(self.size):
            return None
        if not self.size:
            return 0 if self.num_chunks else None
        d = self.dim
        o = offsets[d]
        if any(x for j, x in enumerate(offsets) if j != d):
            return None
        if o == self.size[d]:
            i = -(-o // self.step)  # the first chunk that starts at the end (an empty one)
        elif o % self.step:
            return None
        else:
            i = o // self.step
        return i if 0 <= i < self.num_chunks else None

    def volume(self) -> int:
        """O(1)."""
        if not self.size:
            return self.num_chunks
        d = self.dim
        rows = min(self.size[d], self.num_chunks * self.step)
        return rows * math.prod([s for j, s in enumerate(self.size) if j != d])

    def overlapping(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """O(answer)."""
        if not self.size:
            return super().overlapping(offsets, sizes)
        if math.prod(sizes) == 0:
            return []
        d, step = self.dim, self.step
        lo, hi = offsets[d], offsets[d] + sizes[d]
        first = lo // step
        last = min(self.num_chunks, -(-hi // step))
        return [i for i in range(max(first, 0), last) if self.rows(i) and math.prod(
            [self.rows(i) if j == d else s for j, s in enumerate(self.size)])]

    def same_boxes(self, other: Boxes) -> bool:
        if isinstance(other, GridBoxes) and (self.size, self.dim, self.step, self.num_chunks) == (
                other.size, other.dim, other.step, other.num_chunks):
            return True
        return super().same_boxes(other)

    def __reduce__(self) -> tuple[Any, ...]:
        return (GridBoxes, (self.size, self.dim, self.step, self.num_chunks))


class BoxTable(Boxes):
    """Any list of chunks: ``column`` holds, per chunk, its offsets then its sizes."""

    def __init__(self, size: Sequence[int], count: int, column: Column) -> None:
        self.size = tuple(size)
        self.num_chunks = count
        self.column = column
        self._where: dict[tuple[int, ...], int] | None = None

    def __len__(self) -> int:
        return self.num_chunks

    def box(self, i: int) -> Box:
        nd = len(self.size)
        base = 2 * nd * i
        col = self.column
        return (tuple(col[base + j] for j in range(nd)),
                tuple(col[base + nd + j] for j in range(nd)))

    def index_of(self, offsets: Sequence[int], hint: int | None = None) -> int | None:
        key = tuple(offsets)
        if hint is not None and 0 <= hint < self.num_chunks and self.box(hint)[0] == key:
            return hint
        if self._where is None:
            where: dict[tuple[int, ...], int] = {}
            for i in range(self.num_chunks):
                where.setdefault(self.box(i)[0], i)
            self._where = where
        return self._where.get(key)

    def __reduce__(self) -> tuple[Any, ...]:
        return (BoxTable, (self.size, self.num_chunks, self.column))


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
# Decoding: shared fields.


def _dtype(name: Any) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise ManifestError(f"bad dtype {name!r}")
    if name not in DTYPE_ITEMSIZE:
        raise ManifestError(f"unknown dtype {name!r}")
    return name


def _ints(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _INT64 for x in v):
        raise ManifestError(f"{what} must be a list of ints >= 0 (and below 2**63), got {v!r}"
                            [:300])
    return v


def _size(v: Any, fqn: str) -> tuple[int, ...]:
    """A tensor's global size: ints >= 0 whose product (zeros counted as 1, so that no product
    of some of them overflows either) fits int64, as every tensor's does."""
    size = tuple(_ints(v, f"{fqn}.size"))
    if math.prod(max(d, 1) for d in size) >= _INT64:
        raise ManifestError(f"size {list(size)} of {fqn!r} holds more elements than a tensor can"
                            [:300])
    return size


def _encode_v1(doc: MetadataDoc) -> bytes:
    """Format 1: ``doc`` as one JSON document."""
    tensors: dict[str, Any] = {}
    for fqn, t in doc.tensors.items():
        tensors[fqn] = {
            "dtype": t.dtype,
            "size": list(t.size),
            "chunks": [{"offsets": list(o), "sizes": list(s)} for o, s in t.chunks],
        }
    storage = []
    for fqn, offsets, loc in doc.locations():
        storage.append({
            "fqn": fqn, "offset": None if offsets is None else list(offsets),
            "file": loc.file, "pos": loc.offset, "length": loc.length,
            "checksum": loc.checksum, "enc": loc.enc,
        })
    out: dict[str, Any] = {"format": FORMAT, "version": 1, "dcp_version": doc.dcp_version,
                           "tensors": tensors, "values": list(doc.values), "storage": storage}
    paths = _planner_paths(doc.planner_data)
    if paths is not None:
        out["planner_data"] = paths
    return json.dumps(out, separators=(",", ":")).encode("utf-8")


def _planner_paths(planner_data: Any) -> Any:
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


def _decode_planner_paths(doc: Any) -> dict[str, tuple[str | int, ...]]:
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


def _json_document(raw: bytes, version: int, what: str) -> dict[str, Any]:
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


def _decode_v1(data: bytes) -> MetadataDoc:
    """Format 1 (one JSON document)."""
    doc = _json_document(data, 1, "metadata")
    out: dict[str, TensorEntry] = {}
    keys: set[str] = set()
    tensors = doc.get("tensors")
    values = doc.get("values")
    storage = doc.get("storage")
    if not isinstance(tensors, dict) or not isinstance(values, list) or not isinstance(
            storage, list):
        raise ManifestError("metadata lacks tensors, values or storage")
    for fqn, t in tensors.items():
        if not isinstance(t, dict) or not isinstance(t.get("chunks"), list):
            raise ManifestError(f"bad tensor entry for {fqn!r}")
        size = _size(t.get("size"), fqn)
        boxes: list[Box] = []
        flat: list[int] = []
        for c in t["chunks"]:
            if not isinstance(c, dict):
                raise ManifestError(f"bad chunk for {fqn!r}")
            offs = _ints(c.get("offsets"), f"{fqn} chunk offsets")
            sizes = _ints(c.get("sizes"), f"{fqn} chunk sizes")
            if len(offs) != len(size) or len(sizes) != len(size):
                raise _outside(fqn)
            flat += offs
            flat += sizes
            boxes.append((tuple(offs), tuple(sizes)))
        if len(boxes) != 1 or flat != [0] * len(size) + list(size):  # one whole chunk: fine
            _check_chunks(fqn, size, np.array(flat, dtype=np.int64).reshape(
                len(boxes), 2, len(size)))
        out[fqn] = TensorEntry(_dtype(t.get("dtype")), size, BoxList(size, boxes))
        keys.add(fqn)
    value_keys: list[str] = []
    for fqn in values:
        if not isinstance(fqn, str) or fqn in keys:
            raise ManifestError(f"bad or repeated value key {fqn!r}"[:300])
        keys.add(fqn)
        value_keys.append(fqn)
    is_values = set(value_keys)
    storage_data: dict[StorageKey, ItemLocation] = {}
    for s in storage:
        if not isinstance(s, dict) or not isinstance(s.get("fqn"), str):
            raise ManifestError("bad storage entry")
        fqn = s["fqn"]
        if fqn not in keys:
            raise ManifestError(f"storage entry for unknown key {fqn!r}")
        off = s.get("offset")
        key = (fqn, None if off is None else tuple(_ints(off, f"{fqn} offset")))
        try:
            file = check_file_name(s.get("file"))  # type: ignore[arg-type]
        except ValueError as e:
            raise UnsafePathError(
                f"storage path of {fqn!r} escapes the step directory: {e}") from e
        pos, length = _ints([s.get("pos"), s.get("length")], f"{fqn} position")
        is_value = fqn in is_values
        if (s.get("enc") not in (_VALUE_ENCODINGS if is_value else ENCODINGS)
                or not isinstance(s.get("checksum"), str) or is_value != (off is None)):
            raise ManifestError(f"bad encoding, checksum or offset for {fqn!r}")
        storage_data[key] = ItemLocation(file, pos, length, s["checksum"], s["enc"])
    dcp_version = doc.get("dcp_version")
    planner_data = (_decode_planner_paths(doc["planner_data"]) if doc.get("planner_data")
                    is not None else None)
    return MetadataDoc(out, value_keys, storage_data, planner_data,
                       dcp_version if isinstance(dcp_version, str) else None)


# ---------------------------------------------------------------------------------------------
# Chunks: inside the tensor, covering it exactly once. A restore reads only the chunks that
# overlap what it loads, so a chunk listed twice (or a gap) would leave part of the destination
# as it was, silently; bounds are compared, never added (2**62 + 2**62 wraps in int64).

_Int64s = np.ndarray[Any, np.dtype[np.int64]]


def _outside(fqn: str) -> ManifestError:
    return ManifestError(f"chunk of {fqn!r} lies outside the tensor")


def _not_once(fqn: str, why: str) -> ManifestError:
    return ManifestError(f"chunks of {fqn!r} do not cover the tensor exactly once: {why}")


# Chunk tables that passed the check, by (size, table bytes): a writer emits the same table for
# every tensor of one shape and sharding, so a state of 10k tensors has a handful of distinct
# tables and each is checked once. Bounded; cleared when full.
_CHECKED: dict[tuple[tuple[int, ...], bytes], None] = {}
_MAX_CHECKED = 4096


def _check_chunks(fqn: str, size: tuple[int, ...], box: _Int64s) -> None:
    """:func:`_check_chunk_table`, once per distinct (size, table)."""
    key = (tuple(size), np.ascontiguousarray(box).tobytes())
    if key in _CHECKED:
        return
    _check_chunk_table(fqn, size, box)
    if len(_CHECKED) >= _MAX_CHECKED:
        _CHECKED.clear()
    _CHECKED[key] = None


def _check_chunk_table(fqn: str, size: tuple[int, ...], box: _Int64s) -> None:
    """Raise ManifestError unless the chunks ``box`` (int64, ``[n, 2, ndim]``: offsets then
    sizes, every value in [0, 2**63)) lie inside a tensor of ``size`` and cover each of its
    elements exactly once (empty chunks cover nothing and may sit anywhere inside).

    Exact, and vectorised: an interval sweep when the chunks split one dimension, a product
    check for tiled layouts, else corner parity (below); about ``n log n`` for ``n`` chunks.
    """
    n, nd = box.shape[0], len(size)
    if nd == 0:
        if n != 1:
            raise _not_once(fqn, f"a 0-d tensor has one chunk, the metadata lists {n}")
        return
    offs, lens = box[:, 0, :], box[:, 1, :]
    limit = np.array(size, dtype=np.int64)
    if bool((offs > limit).any()) or bool((lens > limit - offs).any()):
        raise _outside(fqn)
    if math.prod(size) == 0:
        return  # no element to cover: every chunk is empty
    full = (lens > 0).all(axis=1)
    offs, lens = offs[full], lens[full]
    if offs.shape[0] == 0:
        raise _not_once(fqn, "no chunk holds any of its elements")
    # Only the dimensions some chunk does not span whole matter (the others add nothing).
    split = np.flatnonzero(((offs != 0) | (lens != limit)).any(axis=0)).tolist()
    if not split:
        if offs.shape[0] > 1:
            raise _not_once(fqn, f"{offs.shape[0]} chunks each hold the whole tensor")
        return
    lo = np.ascontiguousarray(offs[:, split])
    hi = lo + lens[:, split]  # no overflow: hi <= size
    dims = [size[d] for d in split]
    if len(split) == 1:
        _check_intervals(fqn, split[0], dims[0], lo[:, 0], hi[:, 0])
    elif not _is_product_tiling(lo, hi, dims):
        _check_corner_parity(fqn, lo, hi, dims)


def _check_intervals(fqn: str, dim: int, length: int, lo: _Int64s, hi: _Int64s) -> None:
    """Non-empty intervals [lo, hi) tile [0, length) exactly once: sorted, each starts where
    the previous one ends."""
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    if int(lo[0]) != 0:
        raise _not_once(fqn, f"no chunk holds [0, {int(lo[0])}) of dimension {dim}")
    bad = np.flatnonzero(lo[1:] != hi[:-1])
    if len(bad):
        i = int(bad[0])
        a, b = int(hi[i]), int(lo[i + 1])
        if b < a:
            raise _not_once(fqn, f"chunks at {int(lo[i])} and {b} of dimension {dim} overlap")
        raise _not_once(fqn, f"no chunk holds [{a}, {b}) of dimension {dim}")
    if int(hi[-1]) != length:
        raise _not_once(fqn, f"no chunk holds [{int(hi[-1])}, {length}) of dimension {dim}")


def _is_product_tiling(lo: _Int64s, hi: _Int64s, dims: list[int]) -> bool:
    """Whether the non-empty boxes are exactly the cells of a grid: along each dimension their
    extents are the pieces of one partition (each box spans from a start to the next start),
    and the boxes fall in distinct cells, as many as there are cells (so each cell once).
    False says nothing (an irregular layout may still be exact). 1-d sorts only: fast."""
    n = lo.shape[0]
    cells = 1
    cell = np.zeros(n, dtype=np.int64)
    for j, length in enumerate(dims):
        starts = np.unique(lo[:, j])  # sorted
        if int(starts[0]) != 0:
            return False
        where = np.searchsorted(starts, lo[:, j])
        ends = np.concatenate([starts[1:], np.array([length], dtype=np.int64)])
        if not bool((hi[:, j] == ends[where]).all()):
            return False
        cells *= starts.shape[0]
        if cells > n:
            return False
        cell = cell * starts.shape[0] + where  # < cells <= n: no overflow
    return bool(cells == n) and int(np.unique(cell).shape[0]) == n


def _check_corner_parity(fqn: str, lo: _Int64s, hi: _Int64s, dims: list[int]) -> None:
    """Exact cover by corner parity. A box's indicator is the signed sum of the orthants at its
    2**k corners, and orthants at distinct points are independent (mod 2 too): so the boxes
    cover every element an odd number of times (and nothing outside, as they lie inside) exactly
    when the corners that occur an odd number of times are the tensor's own 2**k corners. Odd
    cover everywhere plus volumes adding up to the tensor's elements is cover exactly once."""
    n, k = lo.shape
    if n << k > _MAX_CORNERS:
        raise _not_once(fqn, f"{n} chunks split {k} dimensions irregularly, more than this "
                        "reader checks")
    volumes = (hi - lo).prod(axis=1)  # each <= the tensor's elements: no overflow
    # Summed in two halves of 31 bits so that overlapping boxes cannot wrap the int64 sum.
    total = (int((volumes >> 31).sum()) << 31) + int((volumes & ((1 << 31) - 1)).sum())
    numel = math.prod(dims)
    if total != numel:
        how = "overlap" if total > numel else "leave a gap"
        raise _not_once(fqn, f"they hold {total} of its {numel} elements (chunks {how})")
    # Coordinates ranked per dimension, so that a corner is one int64 key (1-d sorts are fast).
    lo_rank, hi_rank, counts = [], [], []
    for j, length in enumerate(dims):
        coords, rank = np.unique(np.concatenate([lo[:, j], hi[:, j]]), return_inverse=True)
        rank = rank.reshape(-1).astype(np.int64)
        if int(coords[0]) != 0 or int(coords[-1]) != length:
            raise _not_once(fqn, f"no chunk starts at 0 or ends at {length} of a dimension")
        lo_rank.append(rank[:n])
        hi_rank.append(rank[n:])
        counts.append(coords.shape[0])
    if math.prod(counts) >= _INT64:
        raise _not_once(fqn, f"{n} chunks split {k} dimensions irregularly, more than this "
                        "reader checks")
    keys = []
    for mask in range(1 << k):
        key = np.zeros(n, dtype=np.int64)
        for j in range(k):
            key = key * counts[j] + (hi_rank[j] if (mask >> j) & 1 else lo_rank[j])
        keys.append(key)
    points, times = np.unique(np.concatenate(keys), return_counts=True)
    odd = set(points[times % 2 == 1].tolist())
    own = set()
    for mask in range(1 << k):
        corner = 0
        for j in range(k):
            corner = corner * counts[j] + (counts[j] - 1 if (mask >> j) & 1 else 0)
        own.add(corner)
    if odd != own:
        raise _not_once(fqn, "some elements are in two chunks and others in none")


def serialize_metadata(doc: MetadataDoc, *, version: int = VERSION) -> bytes:
    """``doc`` as metadata bytes: format 2 unless ``version=1`` is asked for or the metadata
    does not fit format 2 (module docstring), then format 1."""
    if version not in VERSIONS:
        raise ValueError(f"metadata version must be one of {VERSIONS}, got {version!r}")
    if version == 2:
        out = _encode_v2(doc)
        if out is not None:
            return out
    return _encode_v1(doc)


def parse_metadata(data: bytes) -> MetadataDoc:
    """Decode and validate :func:`serialize_metadata` bytes (either format).

    Raises:
        ManifestError: the bytes are not valid metadata (bad JSON, header, column, field, dtype
            or path).
        UnsafePathError: a data file name that leaves the step directory.
    """
    if len(data) > MAX_METADATA_BYTES:
        raise ManifestError(f"metadata is {len(data)} bytes, over the limit")
    if bytes(data[:len(MAGIC)]) == MAGIC:
        return _decode_v2(data)
    return _decode_v1(data)


# ---------------------------------------------------------------------------------------------
# Format 2: MAGIC, u64 LE header length, UTF-8 JSON header, zero padding to a multiple of 8,
# then the body of packed native-order int64 columns the header points into.

_MAX_RUNS = 64  # a column of at most this many runs of equal values is stored as its runs


class _NotColumnar(Exception):
    """The metadata does not fit format 2: written as format 1."""


def _column_spec(values: Sequence[int] | _Int64s, body: bytearray, *,
                 arithmetic: bool = True) -> dict[str, Any]:
    """The cheapest description of an int64 column: constant, arithmetic run, runs, packed."""
    t = np.ascontiguousarray(np.asarray(values, dtype=np.int64))
    n = t.shape[0]
    if n == 0:
        return {"c": 0}
    first = int(t[0])
    if n == 1 or bool((t == first).all()):
        return {"c": first}
    if arithmetic:
        step = int(t[1]) - first
        with np.errstate(over="ignore"):
            if bool((t == first + np.arange(n, dtype=np.int64) * step).all()):
                return {"a": [first, step]}
    change = np.flatnonzero(t[1:] != t[:-1])
    if change.shape[0] < _MAX_RUNS:
        ends = [*(change + 1).tolist(), n]
        starts = [0, *ends[:-1]]
        return {"r": [[int(t[s]) for s in starts], ends]}
    body.extend(b"\0" * (-len(body) % 8))
    offset = len(body)
    body.extend(t.tobytes())
    return {"q": offset}


def _grid_of(size: tuple[int, ...], chunks: Boxes) -> GridBoxes | None:
    """``chunks`` as a :class:`GridBoxes` when they are exactly one, else None."""
    if isinstance(chunks, GridBoxes):
        return chunks
    n, nd = len(chunks), len(size)
    if nd == 0:
        return GridBoxes(size, 0, 1, 1) if n == 1 else None
    if n == 0 or any(chunks.box(0)[0]):
        return None
    if n == 1:
        first_sizes = chunks.box(0)[1]
        partial = [j for j in range(nd) if first_sizes[j] != size[j]]
        if len(partial) > 1:
            return None
        dim = partial[0] if partial else 0
        step = max(1, first_sizes[dim])
    else:
        second = chunks.box(1)[0]
        moved = [j for j in range(nd) if second[j]]
        if len(moved) != 1:
            return None
        dim = moved[0]
        step = second[dim]
    grid = GridBoxes(size, dim, step, n)
    if n > -(-size[dim] // step) + 1:
        return None
    for i in range(n):
        offsets, sizes = grid.box(i)
        o, s = chunks.box(i)
        if tuple(o) != offsets or tuple(s) != sizes:
            return None
    return grid


def _checksum_bits(value: str, prefix: str | None) -> tuple[int, str]:
    """(the 64 bits, the prefix) of ``<prefix><16 lowercase hex digits>``."""
    if not isinstance(value, str) or len(value) < 16:
        raise _NotColumnar
    head, digits = value[:-16], value[-16:]
    if prefix is not None and head != prefix:
        raise _NotColumnar
    try:
        bits = int(digits, 16)
    except ValueError:
        raise _NotColumnar from None
    if f"{bits:016x}" != digits:
        raise _NotColumnar
    return bits, head


def _signed(bits: int) -> int:
    return bits - (1 << 64) if bits >= 1 << 63 else bits


def _encode_v2(doc: MetadataDoc) -> bytes | None:
    try:
        return _encode_v2_or_raise(doc)
    except _NotColumnar:
        return None


def _encode_v2_or_raise(doc: MetadataDoc) -> bytes:
    storage = doc.storage
    columnar = storage if isinstance(storage, ColumnarStorage) else None
    # Plain dicts: group the locations by key, then by chunk offsets (one pass).
    by_key: dict[str, dict[tuple[int, ...] | None, Any]] = {}
    if storage and columnar is None:
        for (fqn, offsets), loc in storage.items():  # type: ignore[union-attr]
            by_key.setdefault(fqn, {})[offsets] = loc
    files: dict[str, int] = {}
    if columnar is not None:
        files = {f: i for i, f in enumerate(columnar.files)}
    prefix: str | None = None
    body = bytearray()
    tensors: list[dict[str, Any]] = []
    values: list[list[Any]] = []
    for fqn, te in doc.tensors.items():
        size = te.size
        itemsize = DTYPE_ITEMSIZE.get(te.dtype)
        if itemsize is None:
            raise _NotColumnar
        entry: dict[str, Any] = {"fqn": fqn, "dtype": te.dtype, "size": list(size)}
        grid = _grid_of(size, te.chunks)
        chunks: GridBoxes | BoxTable
        if grid is not None:
            chunks = grid
            entry["grid"] = [grid.dim, grid.step, grid.num_chunks]
        else:
            nd = len(size)
            flat = [x for o, s in te.chunks for x in (*o, *s)]
            if len(flat) != 2 * nd * len(te.chunks):
                raise _NotColumnar
            chunks = BoxTable(size, len(te.chunks), Column.packed(flat))
            entry["count"] = len(te.chunks)
            entry["table"] = _column_spec(flat, body)
        tensors.append(entry)
        if columnar is not None:
            t = columnar.tensors.get(fqn)
            if t is None or not t.chunks.same_boxes(chunks):
                raise _NotColumnar
            if prefix is not None and t.prefix != prefix:
                raise _NotColumnar
            prefix = t.prefix
            entry["loc"] = {"file": _column_spec(t.file.to_array(), body),
                            "pos": _column_spec(t.pos.to_array(), body),
                            "sum": _column_spec(t.checksum.to_array(), body, arithmetic=False)}
            continue
        locs = by_key.pop(fqn, None)
        if locs is None:
            if storage:
                raise _NotColumnar  # a tensor without stored bytes: format 1 says so as it is
            continue
        if len(locs) != len(chunks):
            raise _NotColumnar
        file_col, pos_col, sum_col = [], [], []
        for i in range(len(chunks)):
            offsets, sizes = chunks.box(i)
            loc = locs.get(offsets)
            if (not isinstance(loc, ItemLocation) or loc.enc != "raw"
                    or loc.length != math.prod(sizes) * itemsize):
                raise _NotColumnar
            bits, prefix = _checksum_bits(loc.checksum, prefix)
            file_col.append(files.setdefault(loc.file, len(files)))
            pos_col.append(loc.offset)
            sum_col.append(_signed(bits))
        entry["loc"] = {"file": _column_spec(file_col, body), "pos": _column_spec(pos_col, body),
                        "sum": _column_spec(sum_col, body, arithmetic=False)}
    value_locs: Mapping[str, Any] = (
        columnar.values if columnar is not None else
        {k: v[None] for k, v in by_key.items() if None in v})
    for fqn in doc.values:
        loc = value_locs.get(fqn)
        if loc is None:
            values.append([fqn])
            continue
        if not isinstance(loc, ItemLocation):
            raise _NotColumnar
        values.append([fqn, files.setdefault(loc.file, len(files)), loc.offset, loc.length,
                       loc.checksum, loc.enc])
        by_key.pop(fqn, None)
    if by_key:
        raise _NotColumnar  # locations of keys the metadata does not hold
    header: dict[str, Any] = {
        "format": FORMAT, "version": 2, "dcp_version": doc.dcp_version,
        "byteorder": sys.byteorder, "files": list(files), "checksum_prefix": prefix or "",
        "tensors": tensors, "values": values, "has_storage": storage is not None}
    paths = _planner_paths(doc.planner_data)
    if paths is not None:
        header["planner_data"] = paths
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    out = bytearray(MAGIC)
    out += len(head).to_bytes(8, "little")
    out += head
    out += b"\0" * (-len(out) % 8)
    out += body
    return bytes(out)


def _int(v: Any, what: str, lo: int = 0, hi: int = _INT64) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        below = "2**63" if hi == _INT64 else hi
        raise ManifestError(f"{what} must be an int >= {lo} and < {below}, got {v!r}"[:300])
    return v


class _Body:
    """The body of packed columns, and what the header's columns have taken of it so far."""

    def __init__(self, data: bytearray | memoryview) -> None:
        self.data = data
        self.packed = 0  # bytes of packed columns (the writer packs each column on its own)
        self.expanded = 0  # values of tables expanded from constants, runs and sequences


def _column(spec: Any, n: int, body: _Body, what: str, *, lo: int = -_INT64,
            hi: int = _INT64) -> Column:
    """A column of ``n`` values from its header ``spec``; every value checked in [lo, hi).

    Nothing of size ``n`` is allocated except for a packed column, which the body holds: packed
    columns together may take at most the body's bytes (the writer never shares one), so no
    header can make the decoder read the same bytes over and over.
    """
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ManifestError(f"bad column for {what}")
    kind, arg = next(iter(spec.items()))
    if kind == "c":
        col = Column(n, "c", _int(arg, what, -_INT64))
        ends = [col[0]] if n else []
    elif kind == "a":
        if not isinstance(arg, list) or len(arg) != 2:
            raise ManifestError(f"bad column for {what}")
        start, step = (_int(x, what, -_INT64) for x in arg)
        # Both ends in int64 and the span too, so that start + i * step never wraps.
        if n and abs((n - 1) * step) >= _INT64:
            raise ManifestError(f"a value of {what} is out of range")
        col = Column(n, "a", start, step)
        ends = [start, start + (n - 1) * step] if n else []
    elif kind == "r":
        if not isinstance(arg, list) or len(arg) != 2 or not all(
                isinstance(x, list) for x in arg) or len(arg[0]) != len(arg[1]):
            raise ManifestError(f"bad column for {what}")
        vals = [_int(x, what, -_INT64) for x in arg[0]]
        run_ends = [_int(x, what, 1) for x in arg[1]]
        if any(b <= a for a, b in itertools.pairwise(run_ends)) or (
                run_ends[-1:] != [n]):
            raise ManifestError(f"bad runs in the column for {what}")
        col = Column(n, "r", vals, run_ends)
        ends = vals
    elif kind == "q":
        offset = _int(arg, what)
        if offset % 8 or offset + 8 * n > len(body.data):
            raise ManifestError(f"column for {what} lies outside the metadata")
        body.packed += 8 * n
        if body.packed > len(body.data):
            raise ManifestError(f"column for {what} shares the metadata's bytes with another")
        col = Column(n, "q", body.data, offset)
        if n and (lo > -_INT64 or hi < _INT64):
            t = col.to_array()
            ends = [int(t.min()), int(t.max())]
        else:
            ends = []
    else:
        raise ManifestError(f"bad column kind {kind!r} for {what}"[:300])
    if ends and (min(ends) < lo or max(ends) >= hi):
        raise ManifestError(f"a value of {what} is out of range")
    return col


def _table(spec: Any, fqn: str, size: tuple[int, ...], count: int, body: _Body) -> BoxTable:
    """The chunk table of ``count`` chunks of tensor ``fqn``, checked (:func:`_check_chunks`)."""
    nd = len(size)
    if nd == 0 and count != 1:
        raise _not_once(fqn, f"a 0-d tensor has one chunk, the metadata lists {count}")
    if count > _MAX_CHUNKS:
        raise ManifestError(f"{fqn!r} has {count} chunks, more than this reader accepts")
    n = 2 * nd * count
    col = _column(spec, n, body, f"{fqn} chunks", lo=0)
    if col.kind != "q":
        # Not bounded by the file's bytes: by the limits above, before expanding anything.
        body.expanded += n
        if n > _MAX_TABLE_VALUES or body.expanded > _MAX_EXPANDED_VALUES:
            raise ManifestError(f"the chunk table of {fqn!r} ({count} chunks) is not packed; "
                                "this reader expands at most "
                                f"{_MAX_TABLE_VALUES} values of such tables")
    _check_chunks(fqn, size, col.to_array().reshape(count, 2, nd))
    return BoxTable(size, count, col)


def _grid(g: Any, fqn: str, size: tuple[int, ...]) -> GridBoxes:
    """The chunk grid ``[dim, step, count]`` of tensor ``fqn``, checked: inside the tensor (at
    most one chunk starts at its end) and covering it whole."""
    if not isinstance(g, list) or len(g) != 3:
        raise ManifestError(f"bad chunk grid for {fqn!r}")
    dim, step, count = (_int(x, f"{fqn} grid") for x in g)
    if count < 1 or step < 1 or (size and (dim >= len(size) or count > -(
            -size[dim] // step) + 1)) or (not size and count != 1):
        raise ManifestError(f"chunk grid of {fqn!r} lies outside the tensor")
    if len(size) and 0 not in size and count * step < size[dim]:
        raise _not_once(fqn, f"no chunk holds [{count * step}, {size[dim]}) of dimension {dim}")
    return GridBoxes(size, dim, step, count)


def _swap_body(body: bytearray) -> None:
    """Packed columns written on a host of the other byte order, in place."""
    if len(body) < 8:
        return
    t = np.frombuffer(body, dtype=np.uint8, count=len(body) // 8 * 8).reshape(-1, 8)
    t[:] = t[:, ::-1].copy()


def _decode_v2(data: bytes) -> MetadataDoc:
    if len(data) < 16:
        raise ManifestError("metadata header is truncated")
    hlen = int.from_bytes(data[8:16], "little")
    if 16 + hlen > len(data):
        raise ManifestError("metadata header lies outside the file")
    doc = _json_document(bytes(data[16:16 + hlen]), 2, "metadata header")
    start = 16 + hlen + (-(16 + hlen) % 8)
    # The columns are read in place (no copy: most of the bytes are checksums, read only for
    # the chunks a rank restores); a column whose values are bounded is range-checked here.
    if doc.get("byteorder") not in ("little", "big"):
        raise ManifestError(f"bad byteorder {doc.get('byteorder')!r}")
    packed: bytearray | memoryview = memoryview(data)[start:]
    if doc["byteorder"] != sys.byteorder:
        packed = bytearray(packed)
        _swap_body(packed)
    body = _Body(packed)
    files, tensors, values = doc.get("files"), doc.get("tensors"), doc.get("values")
    prefix = doc.get("checksum_prefix")
    if not isinstance(files, list) or not isinstance(tensors, list) or not isinstance(
            values, list) or not isinstance(prefix, str):
        raise ManifestError("metadata lacks files, tensors, values or checksum_prefix")
    for name in files:
        try:
            check_file_name(name)
        except (ValueError, TypeError) as e:
            raise UnsafePathError(f"data file {name!r} escapes the step directory: {e}") from e
    out: dict[str, TensorEntry] = {}
    locs: dict[str, TensorLocations] = {}
    num_chunks = 0
    for t in tensors:
        if not isinstance(t, dict) or not isinstance(t.get("fqn"), str):
            raise ManifestError("bad tensor entry")
        fqn = t["fqn"]
        if fqn in out:
            raise ManifestError(f"tensor {fqn!r} appears twice")
        size = _size(t.get("size"), fqn)
        dtype = _dtype(t.get("dtype"))
        chunks: GridBoxes | BoxTable
        if "grid" in t:
            chunks = _grid(t["grid"], fqn, size)
        else:
            chunks = _table(t.get("table"), fqn, size, _int(t.get("count"), f"{fqn} count"),
                            body)
        num_chunks += len(chunks)
        if num_chunks > _MAX_CHUNKS:
            raise ManifestError(f"the metadata lists over {_MAX_CHUNKS} chunks (at {fqn!r}), "
                                "more than this reader accepts")
        out[fqn] = TensorEntry(dtype, size, chunks)
        loc = t.get("loc")
        if loc is None:
            continue
        if not isinstance(loc, dict):
            raise ManifestError(f"bad locations for {fqn!r}")
        n = len(chunks)
        locs[fqn] = TensorLocations(
            chunks, DTYPE_ITEMSIZE[dtype],
            _column(loc.get("file"), n, body, f"{fqn} files", lo=0, hi=len(files)),
            _column(loc.get("pos"), n, body, f"{fqn} positions", lo=0),
            _column(loc.get("sum"), n, body, f"{fqn} checksums"), prefix)
    value_keys: list[str] = []
    seen: set[str] = set()
    value_locs: dict[str, ItemLocation] = {}
    for v in values:
        if not isinstance(v, list) or not v or not isinstance(v[0], str) or v[0] in out or (
                v[0] in seen):
            raise ManifestError(f"bad value entry {v!r}"[:200])
        fqn = v[0]
        value_keys.append(fqn)
        seen.add(fqn)
        if len(v) == 1:
            continue
        if len(v) != 6:
            raise ManifestError(f"bad value entry for {fqn!r}")
        fi = _int(v[1], f"{fqn} file")
        if fi >= len(files):
            raise ManifestError(f"value {fqn!r} names file {fi} of {len(files)}")
        pos, length = _int(v[2], f"{fqn} position"), _int(v[3], f"{fqn} length")
        if v[5] not in _VALUE_ENCODINGS or not isinstance(v[4], str):
            raise ManifestError(f"bad encoding or checksum for {fqn!r}")
        value_locs[fqn] = ItemLocation(files[fi], pos, length, v[4], v[5])
    dcp_version = doc.get("dcp_version")
    planner_data = (_decode_planner_paths(doc["planner_data"]) if doc.get("planner_data")
                    is not None else None)
    storage = ColumnarStorage(files, locs, value_locs) if doc.get("has_storage") else None
    return MetadataDoc(out, value_keys, storage, planner_data,
                       dcp_version if isinstance(dcp_version, str) else None)
