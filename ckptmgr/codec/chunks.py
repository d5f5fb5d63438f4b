"""A tensor's stored chunks, torch-free: compact sequences of boxes and the check that they
cover the tensor exactly once.

A chunk is a :data:`Box` (offsets and sizes per dimension). The metadata formats keep a tensor's
chunks as a :class:`Boxes`: listed one by one (:class:`BoxList`, format 1 and metadata built in
memory), a regular split of one dimension (:class:`GridBoxes`, FSDP2's ``Shard(0)``) or a table
of int64 values (:class:`BoxTable` over a :class:`Column`); the last two make a box only when
asked, so that an FSDP2 checkpoint of N ranks does not cost O(ranks x tensors) Python objects
to decode. :func:`check_chunks` refuses any layout that leaves part of a tensor uncovered or
covers it twice.

Every number in the metadata is an int64; the checks use numpy, never torch.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ckptmgr.codec.manifest import ManifestError

__all__ = ["INT64_END", "Box", "BoxList", "BoxTable", "Boxes", "Column", "GridBoxes", "Int64s",
           "check_chunks", "not_covered_once", "outside_tensor"]

INT64_END = 1 << 63  # every number in metadata is an int64: each lies in [-2**63, INT64_END)
# Checking an irregular N-d chunk layout costs (chunks x 2**dims split) corner points; beyond
# this many the layout is refused (no writer makes one: real layouts are grids of tiles).
_MAX_CORNERS = 1 << 26

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""One chunk: its offsets and its sizes, per dimension."""

Int64s = np.ndarray[Any, np.dtype[np.int64]]


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


# ---------------------------------------------------------------------------------------------
# Chunks: inside the tensor, covering it exactly once. A restore reads only the chunks that
# overlap what it loads, so a chunk listed twice (or a gap) would leave part of the destination
# as it was, silently; bounds are compared, never added (2**62 + 2**62 wraps in int64).


def outside_tensor(fqn: str) -> ManifestError:
    """The error for a chunk of ``fqn`` that lies outside the tensor."""
    return ManifestError(f"chunk of {fqn!r} lies outside the tensor")


def not_covered_once(fqn: str, why: str) -> ManifestError:
    """The error for chunks of ``fqn`` that do not cover it exactly once (``why``)."""
    return ManifestError(f"chunks of {fqn!r} do not cover the tensor exactly once: {why}")


# Chunk tables that passed the check, by (size, table bytes): a writer emits the same table for
# every tensor of one shape and sharding, so a state of 10k tensors has a handful of distinct
# tables and each is checked once. Bounded; cleared when full.
_CHECKED: dict[tuple[tuple[int, ...], bytes], None] = {}
_MAX_CHECKED = 4096


def check_chunks(fqn: str, size: tuple[int, ...], box: Int64s) -> None:
    """:func:`_check_chunk_table`, once per distinct (size, table)."""
    key = (tuple(size), np.ascontiguousarray(box).tobytes())
    if key in _CHECKED:
        return
    _check_chunk_table(fqn, size, box)
    if len(_CHECKED) >= _MAX_CHECKED:
        _CHECKED.clear()
    _CHECKED[key] = None


def _check_chunk_table(fqn: str, size: tuple[int, ...], box: Int64s) -> None:
    """Raise ManifestError unless the chunks ``box`` (int64, ``[n, 2, ndim]``: offsets then
    sizes, every value in [0, 2**63)) lie inside a tensor of ``size`` and cover each of its
    elements exactly once (empty chunks cover nothing and may sit anywhere inside).

    Exact, and vectorised: an interval sweep when the chunks split one dimension, a product
    check for tiled layouts, else corner parity (below); about ``n log n`` for ``n`` chunks.
    """
    n, nd = box.shape[0], len(size)
    if nd == 0:
        if n != 1:
            raise not_covered_once(fqn, f"a 0-d tensor has one chunk, the metadata lists {n}")
        return
    offs, lens = box[:, 0, :], box[:, 1, :]
    limit = np.array(size, dtype=np.int64)
    if bool((offs > limit).any()) or bool((lens > limit - offs).any()):
        raise outside_tensor(fqn)
    if math.prod(size) == 0:
        return  # no element to cover: every chunk is empty
    full = (lens > 0).all(axis=1)
    offs, lens = offs[full], lens[full]
    if offs.shape[0] == 0:
        raise not_covered_once(fqn, "no chunk holds any of its elements")
    # Only the dimensions some chunk does not span whole matter (the others add nothing).
    split = np.flatnonzero(((offs != 0) | (lens != limit)).any(axis=0)).tolist()
    if not split:
        if offs.shape[0] > 1:
            raise not_covered_once(fqn, f"{offs.shape[0]} chunks each hold the whole tensor")
        return
    lo = np.ascontiguousarray(offs[:, split])
    hi = lo + lens[:, split]  # no overflow: hi <= size
    dims = [size[d] for d in split]
    if len(split) == 1:
        _check_intervals(fqn, split[0], dims[0], lo[:, 0], hi[:, 0])
    elif not _is_product_tiling(lo, hi, dims):
        _check_corner_parity(fqn, lo, hi, dims)


def _check_intervals(fqn: str, dim: int, length: int, lo: Int64s, hi: Int64s) -> None:
    """Non-empty intervals [lo, hi) tile [0, length) exactly once: sorted, each starts where
    the previous one ends."""
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    if int(lo[0]) != 0:
        raise not_covered_once(fqn, f"no chunk holds [0, {int(lo[0])}) of dimension {dim}")
    bad = np.flatnonzero(lo[1:] != hi[:-1])
    if len(bad):
        i = int(bad[0])
        a, b = int(hi[i]), int(lo[i + 1])
        if b < a:
            raise not_covered_once(
                fqn, f"chunks at {int(lo[i])} and {b} of dimension {dim} overlap")
        raise not_covered_once(fqn, f"no chunk holds [{a}, {b}) of dimension {dim}")
    if int(hi[-1]) != length:
        raise not_covered_once(fqn, f"no chunk holds [{int(hi[-1])}, {length}) of dimension {dim}")


def _is_product_tiling(lo: Int64s, hi: Int64s, dims: list[int]) -> bool:
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


def _check_corner_parity(fqn: str, lo: Int64s, hi: Int64s, dims: list[int]) -> None:
    """Exact cover by corner parity. A box's indicator is the signed sum of the orthants at its
    2**k corners, and orthants at distinct points are independent (mod 2 too): so the boxes
    cover every element an odd number of times (and nothing outside, as they lie inside) exactly
    when the corners that occur an odd number of times are the tensor's own 2**k corners. Odd
    cover everywhere plus volumes adding up to the tensor's elements is cover exactly once."""
    n, k = lo.shape
    if n << k > _MAX_CORNERS:
        raise not_covered_once(fqn, f"{n} chunks split {k} dimensions irregularly, more than this "
                        "reader checks")
    volumes = (hi - lo).prod(axis=1)  # each <= the tensor's elements: no overflow
    # Summed in two halves of 31 bits so that overlapping boxes cannot wrap the int64 sum.
    total = (int((volumes >> 31).sum()) << 31) + int((volumes & ((1 << 31) - 1)).sum())
    numel = math.prod(dims)
    if total != numel:
        how = "overlap" if total > numel else "leave a gap"
        raise not_covered_once(fqn, f"they hold {total} of its {numel} elements (chunks {how})")
    # Coordinates ranked per dimension, so that a corner is one int64 key (1-d sorts are fast).
    lo_rank, hi_rank, counts = [], [], []
    for j, length in enumerate(dims):
        coords, rank = np.unique(np.concatenate([lo[:, j], hi[:, j]]), return_inverse=True)
        rank = rank.reshape(-1).astype(np.int64)
        if int(coords[0]) != 0 or int(coords[-1]) != length:
            raise not_covered_once(fqn, f"no chunk starts at 0 or ends at {length} of a dimension")
        lo_rank.append(rank[:n])
        hi_rank.append(rank[n:])
        counts.append(coords.shape[0])
    if math.prod(counts) >= INT64_END:
        raise not_covered_once(fqn, f"{n} chunks split {k} dimensions irregularly, more than this "
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
        raise not_covered_once(fqn, "some elements are in two chunks and others in none")
