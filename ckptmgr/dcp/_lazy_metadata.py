"""Compact, lazily expanded pieces of DCP ``Metadata``: what metadata format 2 decodes into.

At N ranks an FSDP2 checkpoint has N chunks per sharded tensor; building N
``ChunkStorageMetadata`` and N storage entries per tensor when the metadata is read costs
O(ranks x tensors) Python objects (seconds at 16k ranks). These classes hold the same
information in O(tensors) objects and make a chunk or a location only when asked:

- :class:`GridChunks`: the chunks of a regular split along one dimension (FSDP2's ``Shard(0)``:
  ``count`` chunks of ``step`` rows, the last ones shorter or empty), a ``Sequence`` of
  ``ChunkStorageMetadata``;
- :class:`ChunkTable`: any other list of chunks, as one flat int64 column;
- :class:`ColumnarLocations`: ``storage_data`` as a ``Mapping`` from ``MetadataIndex`` to
  :class:`ItemLocation`, with one file / position / checksum column per tensor.

They are what DCP's planners expect (``md.chunks`` is iterated and indexed, ``storage_data`` is
looked up by ``MetadataIndex``), compare equal to the plain lists and dicts they stand for, and
pickle as their compact columns (the coordinator broadcasts restore metadata).
:func:`find_chunk`, :func:`overlapping_chunks` and :func:`stored_volume` answer the questions
restores ask in O(1) or O(answer) for a grid, and by a scan for anything else.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

__all__ = [
    "ChunkTable", "Column", "ColumnarLocations", "GridChunks", "ItemLocation", "TensorLocations",
    "find_chunk", "overlapping_chunks", "stored_volume",
]


@dataclass(frozen=True)
class ItemLocation:
    """Where one stored item's bytes are, inside the step directory."""

    file: str
    offset: int
    length: int
    checksum: str
    enc: str  # "raw" tensor bytes, "json" tagged JSON value, "pickle" torch.save bytes


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

    def to_tensor(self) -> torch.Tensor:
        """All values as an int64 tensor (a view of the bytes for a packed column)."""
        k = self.kind
        if k == "c":
            return torch.full((self.n,), int(self.a), dtype=torch.int64)
        if k == "a":
            return int(self.a) + torch.arange(self.n, dtype=torch.int64) * int(self.b)
        if k == "r":
            counts = torch.tensor(self.b, dtype=torch.int64).diff(
                prepend=torch.zeros(1, dtype=torch.int64))
            return torch.tensor(self.a, dtype=torch.int64).repeat_interleave(counts)
        if self.n == 0:
            return torch.zeros(0, dtype=torch.int64)
        buf = self.a
        offset = self.b
        if not isinstance(buf, bytearray):  # read-only memory: torch wants a writable buffer
            buf, offset = bytearray(memoryview(buf)[offset:offset + 8 * self.n]), 0
        out: torch.Tensor = torch.frombuffer(buf, dtype=torch.int64, count=self.n,
                                             offset=offset)
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        if self.kind == "q" and not isinstance(self.a, bytearray):
            # A view of the metadata file's bytes: pickle only this column's.
            return (Column, (self.n, "q", bytearray(
                memoryview(self.a)[self.b:self.b + 8 * self.n]), 0))
        return (Column, (self.n, self.kind, self.a, self.b))


def _prod(xs: Sequence[int]) -> int:
    return math.prod(xs)


class _ChunkSeq(Sequence[ChunkStorageMetadata]):
    """Shared sequence behaviour: equality with any sequence of chunks, no hashing."""

    size: tuple[int, ...]

    @overload
    def __getitem__(self, i: int) -> ChunkStorageMetadata: ...

    @overload
    def __getitem__(self, i: slice) -> list[ChunkStorageMetadata]: ...

    def __getitem__(self, i: int | slice) -> ChunkStorageMetadata | list[ChunkStorageMetadata]:
        if isinstance(i, slice):
            return [self.chunk(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return self.chunk(i)

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        for i in range(len(self)):
            yield self.chunk(i)

    def chunk(self, i: int) -> ChunkStorageMetadata:
        offsets, sizes = self.box(i)
        return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))

    def box(self, i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        raise NotImplementedError

    def index_of(self, offsets: Sequence[int], hint: int | None = None) -> int | None:
        """The index of the chunk at ``offsets``, or None."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if isinstance(self, GridChunks) and isinstance(other, GridChunks):
            return (self.size, self.dim, self.step, self.num_chunks) == (
                other.size, other.dim, other.step, other.num_chunks) or (
                len(self) == len(other) and all(
                    self.box(i) == other.box(i) for i in range(len(self))))
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} chunks of {list(self.size)})"


class GridChunks(_ChunkSeq):
    """``count`` chunks splitting dimension ``dim`` of a tensor of ``size`` into runs of
    ``step`` (torch.chunk's rule, which FSDP2's ``Shard(0)`` follows): chunk i starts at
    ``min(i * step, size[dim])`` along ``dim`` (0 elsewhere) and spans
    ``min(step, size[dim] - i * step)`` of it, at least 0 (the whole of every other
    dimension); at most one chunk starts at the end (an empty one, as DCP's dedup keeps). A 0-d
    tensor has one chunk, its whole self. (The attribute is ``num_chunks``: ``count`` is
    ``Sequence.count``.)"""

    def __init__(self, size: Sequence[int], dim: int, step: int, count: int) -> None:
        self.size = tuple(size)
        self.dim, self.step, self.num_chunks = dim, step, count

    def __len__(self) -> int:
        return self.num_chunks

    def box(self, i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
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

    def __reduce__(self) -> tuple[Any, ...]:
        return (GridChunks, (self.size, self.dim, self.step, self.num_chunks))


class ChunkTable(_ChunkSeq):
    """Any list of chunks: ``column`` holds, per chunk, its offsets then its sizes."""

    def __init__(self, size: Sequence[int], count: int, column: Column) -> None:
        self.size = tuple(size)
        self.num_chunks = count
        self.column = column
        self._where: dict[tuple[int, ...], int] | None = None

    def __len__(self) -> int:
        return self.num_chunks

    def box(self, i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
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
        return (ChunkTable, (self.size, self.num_chunks, self.column))


def find_chunk(chunks: Sequence[ChunkStorageMetadata], offsets: Sequence[int],
               hint: int | None = None) -> ChunkStorageMetadata | None:
    """The chunk of ``chunks`` at ``offsets`` (a lookup for compact sequences, a scan else)."""
    if isinstance(chunks, _ChunkSeq):
        i = chunks.index_of(offsets, hint)
        return None if i is None else chunks.chunk(i)
    key = tuple(offsets)
    if hint is not None and 0 <= hint < len(chunks) and tuple(chunks[hint].offsets) == key:
        return chunks[hint]
    for c in chunks:
        if tuple(c.offsets) == key:
            return c
    return None


def overlapping_chunks(chunks: Sequence[ChunkStorageMetadata], offsets: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
    """Indices of the non-empty chunks that share an element with the box (``offsets``,
    ``sizes``); O(answer) for a :class:`GridChunks`."""
    if _prod(sizes) == 0:
        return []
    if isinstance(chunks, GridChunks) and chunks.size:
        d, step = chunks.dim, chunks.step
        lo, hi = offsets[d], offsets[d] + sizes[d]
        first = lo // step
        last = min(chunks.num_chunks, -(-hi // step))
        return [i for i in range(max(first, 0), last) if chunks.rows(i) and _prod(
            [chunks.rows(i) if j == d else s for j, s in enumerate(chunks.size)])]
    out = []
    for i, c in enumerate(chunks):
        if _prod(c.sizes) and all(a < b + bs and b < a + as_ for a, as_, b, bs in zip(
                offsets, sizes, c.offsets, c.sizes, strict=True)):
            out.append(i)
    return out


def stored_volume(chunks: Sequence[ChunkStorageMetadata]) -> int:
    """Elements the chunks hold in total (O(1) for a :class:`GridChunks`)."""
    if isinstance(chunks, GridChunks):
        if not chunks.size:
            return chunks.num_chunks
        d = chunks.dim
        rows = min(chunks.size[d], chunks.num_chunks * chunks.step)
        return rows * _prod([s for j, s in enumerate(chunks.size) if j != d])
    return sum(_prod(c.sizes) for c in chunks)


@dataclass(frozen=True)
class TensorLocations:
    """Where each chunk of one tensor is stored: file index (into the files table), position,
    and the checksum's 64 bits (written as ``prefix`` + 16 hex digits); the length is the chunk's
    elements times ``itemsize``."""

    chunks: GridChunks | ChunkTable
    itemsize: int
    file: Column
    pos: Column
    checksum: Column
    prefix: str

    def location(self, files: Sequence[str], i: int) -> ItemLocation:
        c = self.chunks
        if isinstance(c, GridChunks):
            if c.size:
                d = c.dim
                n = c.rows(i) * _prod([s for j, s in enumerate(c.size) if j != d])
            else:
                n = 1
        else:
            n = _prod(c.box(i)[1])
        bits = self.checksum[i] & ((1 << 64) - 1)
        return ItemLocation(files[self.file[i]], self.pos[i], n * self.itemsize,
                            f"{self.prefix}{bits:016x}", "raw")


class ColumnarLocations(Mapping[MetadataIndex, ItemLocation]):
    """``storage_data`` of format-2 metadata: ``MetadataIndex`` -> :class:`ItemLocation`, made
    on lookup from per-tensor columns (tensor chunks) or taken from a small dict (values)."""

    def __init__(self, files: Sequence[str], tensors: Mapping[str, TensorLocations],
                 values: Mapping[MetadataIndex, ItemLocation]) -> None:
        self.files = tuple(files)
        self.tensors = dict(tensors)
        self.value_locations = dict(values)

    def __getitem__(self, idx: MetadataIndex) -> ItemLocation:
        if idx.offset is None:
            return self.value_locations[idx]
        t = self.tensors.get(idx.fqn)
        if t is None:
            raise KeyError(idx)
        i = t.chunks.index_of(idx.offset, idx.index)
        if i is None:
            raise KeyError(idx)
        return t.location(self.files, i)

    def __contains__(self, idx: object) -> bool:
        if not isinstance(idx, MetadataIndex):
            return False
        try:
            self[idx]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn, t in self.tensors.items():
            for i in range(len(t.chunks)):
                yield MetadataIndex(fqn, t.chunks.box(i)[0], i)
        yield from self.value_locations

    def __len__(self) -> int:
        return len(self.value_locations) + sum(len(t.chunks) for t in self.tensors.values())

    def __reduce__(self) -> tuple[Any, ...]:
        return (ColumnarLocations, (self.files, self.tensors, self.value_locations))

    def __repr__(self) -> str:
        return (f"ColumnarLocations({len(self.tensors)} tensors, "
                f"{len(self.value_locations)} values, {len(self.files)} files)")


