"""Metadata format 2: a JSON header plus packed integer columns (written since issue 18).

Per tensor its chunks are one record when they split one dimension regularly (FSDP2's
``Shard(0)``: "N chunks of r rows, the last ones shorter", a :class:`~.chunks.GridBoxes`) or
one int64 column otherwise (a :class:`~.chunks.BoxTable`); storage locations (file, position,
checksum) are columns too, each stored as a constant, an arithmetic run, runs of equal values
or packed ints; lengths follow from the chunk sizes. Decoding is O(tensors) plus vectorised
range checks of the packed columns, and gives lazy chunk sequences and lazy locations
(:class:`~.metadata.ColumnarStorage`) that make a chunk or a location only when asked: at N
ranks an FSDP2 checkpoint has N chunks per sharded tensor, and building them all costs
O(ranks x tensors) Python objects (seconds at 16k ranks).

The bytes: :data:`MAGIC`, u64 LE header length, UTF-8 JSON header, zero padding to a multiple
of 8, then the body of packed native-order int64 columns the header points into. Metadata
that does not fit this model is written as format 1 (:mod:`.metadata_json`).
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ckptmgr.codec.chunks import (
    INT64_END,
    Boxes,
    BoxList,
    BoxTable,
    Column,
    GridBoxes,
    Int64s,
    check_chunks,
    not_covered_once,
)
from ckptmgr.codec.dtypes import DTYPE_ITEMSIZE
from ckptmgr.codec.layout import check_stored_name
from ckptmgr.codec.manifest import ManifestError, UnsafePathError
from ckptmgr.codec.metadata import (
    FORMAT,
    VALUE_ENCODINGS,
    ColumnarStorage,
    ItemLocation,
    MetadataDoc,
    TensorEntry,
    TensorLocations,
    decode_planner_paths,
    encode_planner_paths,
    load_document,
    read_dtype,
    read_size,
)

__all__ = ["MAGIC", "decode_columnar_metadata", "encode_columnar_metadata"]

MAGIC = b"CKPTMDv2"  # format 2 starts with these 8 bytes, then the header length (u64 LE)
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
_MAX_RUNS = 64  # a column of at most this many runs of equal values is stored as its runs


class _NotColumnar(Exception):
    """The metadata does not fit format 2: written as format 1."""


def _column_spec(values: Sequence[int] | Int64s, body: bytearray, *,
                 arithmetic: bool = True) -> dict[str, Any]:
    """The cheapest description of an int64 column: constant, arithmetic run, runs, packed."""
    # One chunk per tensor (every unsharded tensor): no array for one value. A value out of
    # int64's range takes numpy's path below, which refuses it as before.
    if (isinstance(values, list) and len(values) == 1 and type(values[0]) is int
            and -(1 << 63) <= values[0] < 1 << 63):
        return {"c": values[0]}
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
    if type(chunks) is BoxList and len(chunks.boxes) == 1:
        # The common case (an unsharded tensor): one chunk, the whole tensor. What the general
        # path below finds for it (the same values, the same checks), without building and
        # comparing its box.
        offsets, sizes = chunks.boxes[0]
        if len(offsets) == len(sizes) == len(size) and tuple(sizes) == size and not any(offsets):
            if not size:
                return GridBoxes(size, 0, 1, 1)
            step = max(1, sizes[0])
            # (the general path's check below, for its one chunk)
            return None if -(-size[0] // step) + 1 < 1 else GridBoxes(size, 0, step, 1)
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


def _whole_chunk(grid: GridBoxes, size: tuple[int, ...]) -> bool:
    """Whether ``grid`` is one chunk that is the whole tensor, so that its box is (zeros,
    ``size``) without building it (:meth:`GridBoxes.box` of chunk 0, for the same values)."""
    return grid.num_chunks == 1 and (not size or 0 <= size[grid.dim] <= grid.step)


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


def encode_columnar_metadata(doc: MetadataDoc) -> bytes | None:
    """``doc`` as format 2, or None when it does not fit the format (module docstring)."""
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
        whole = grid is not None and _whole_chunk(grid, size)
        for i in range(len(chunks)):
            offsets, sizes = ((0,) * len(size), size) if whole else chunks.box(i)
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
    paths = encode_planner_paths(doc.planner_data)
    if paths is not None:
        header["planner_data"] = paths
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    out = bytearray(MAGIC)
    out += len(head).to_bytes(8, "little")
    out += head
    out += b"\0" * (-len(out) % 8)
    out += body
    return bytes(out)


def _int(v: Any, what: str, lo: int = 0, hi: int = INT64_END) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        below = "2**63" if hi == INT64_END else hi
        raise ManifestError(f"{what} must be an int >= {lo} and < {below}, got {v!r}"[:300])
    return v


class _Body:
    """The body of packed columns, and what the header's columns have taken of it so far."""

    def __init__(self, data: bytearray | memoryview) -> None:
        self.data = data
        self.packed = 0  # bytes of packed columns (the writer packs each column on its own)
        self.expanded = 0  # values of tables expanded from constants, runs and sequences


def _column(spec: Any, n: int, body: _Body, what: str, *, lo: int = -INT64_END,
            hi: int = INT64_END) -> Column:
    """A column of ``n`` values from its header ``spec``; every value checked in [lo, hi).

    Nothing of size ``n`` is allocated except for a packed column, which the body holds: packed
    columns together may take at most the body's bytes (the writer never shares one), so no
    header can make the decoder read the same bytes over and over.
    """
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ManifestError(f"bad column for {what}")
    kind, arg = next(iter(spec.items()))
    if kind == "c":
        col = Column(n, "c", _int(arg, what, -INT64_END))
        ends = [col[0]] if n else []
    elif kind == "a":
        if not isinstance(arg, list) or len(arg) != 2:
            raise ManifestError(f"bad column for {what}")
        start, step = (_int(x, what, -INT64_END) for x in arg)
        # Both ends in int64 and the span too, so that start + i * step never wraps.
        if n and abs((n - 1) * step) >= INT64_END:
            raise ManifestError(f"a value of {what} is out of range")
        col = Column(n, "a", start, step)
        ends = [start, start + (n - 1) * step] if n else []
    elif kind == "r":
        if not isinstance(arg, list) or len(arg) != 2 or not all(
                isinstance(x, list) for x in arg) or len(arg[0]) != len(arg[1]):
            raise ManifestError(f"bad column for {what}")
        vals = [_int(x, what, -INT64_END) for x in arg[0]]
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
        if n and (lo > -INT64_END or hi < INT64_END):
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
    """The chunk table of ``count`` chunks of tensor ``fqn``, checked (:func:`check_chunks`)."""
    nd = len(size)
    if nd == 0 and count != 1:
        raise not_covered_once(fqn, f"a 0-d tensor has one chunk, the metadata lists {count}")
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
    check_chunks(fqn, size, col.to_array().reshape(count, 2, nd))
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
        raise not_covered_once(
            fqn, f"no chunk holds [{count * step}, {size[dim]}) of dimension {dim}")
    return GridBoxes(size, dim, step, count)


def _swap_body(body: bytearray) -> None:
    """Packed columns written on a host of the other byte order, in place."""
    if len(body) < 8:
        return
    t = np.frombuffer(body, dtype=np.uint8, count=len(body) // 8 * 8).reshape(-1, 8)
    t[:] = t[:, ::-1].copy()


def decode_columnar_metadata(data: bytes) -> MetadataDoc:
    """Format 2 bytes (they start with :data:`MAGIC`), decoded and checked."""
    if len(data) < 16:
        raise ManifestError("metadata header is truncated")
    hlen = int.from_bytes(data[8:16], "little")
    if 16 + hlen > len(data):
        raise ManifestError("metadata header lies outside the file")
    doc = load_document(bytes(data[16:16 + hlen]), 2, "metadata header")
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
            check_stored_name(name)
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
        size = read_size(t.get("size"), fqn)
        dtype = read_dtype(t.get("dtype"))
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
        if v[5] not in VALUE_ENCODINGS or not isinstance(v[4], str):
            raise ManifestError(f"bad encoding or checksum for {fqn!r}")
        value_locs[fqn] = ItemLocation(files[fi], pos, length, v[4], v[5])
    dcp_version = doc.get("dcp_version")
    planner_data = (decode_planner_paths(doc["planner_data"]) if doc.get("planner_data")
                    is not None else None)
    storage = ColumnarStorage(files, locs, value_locs) if doc.get("has_storage") else None
    return MetadataDoc(out, value_keys, storage, planner_data,
                       dcp_version if isinstance(dcp_version, str) else None)
