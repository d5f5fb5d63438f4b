"""DCP ``Metadata`` as bytes and back, so reading a checkpoint never runs pickle.

The encoding holds what loading needs: per key, tensor dtype, global size and stored chunks, or a
marker for an encoded Python value; and per stored item, where its bytes are (file, offset, length),
their checksum and encoding. Decoding validates every field and every path.

Two formats (docs/byte-format.md), both read by :func:`decode_metadata`:

- **format 2** (written since issue 18): a JSON header plus packed integer columns. Per tensor its
  chunks are one record when they split one dimension regularly (FSDP2's ``Shard(0)``: "N chunks
  of r rows, the last ones shorter") or one int64 column otherwise; storage locations (file,
  position, checksum) are columns too, each stored as a constant, an arithmetic run, runs of
  equal values or packed ints; lengths follow from the chunk sizes. Decoding is O(tensors) plus
  vectorised range checks of the packed columns, and gives lazy ``md.chunks`` sequences and a
  lazy ``storage_data`` mapping (:mod:`._lazy_metadata`).
- **format 1**: one JSON document with an object per chunk and per stored item
  (O(ranks x tensors) objects); still written when the metadata does not fit format 2's model
  (a tensor item not stored raw, a checksum that is not ``<prefix><16 hex digits>``, a length
  other than the chunk's bytes).

Optional, when the save planner flattened a nested state dict (DCP's default planners do):
``planner_data``, each flat key's path in the nested dict (tagged JSON: str keys and int list
indices), which DCP's own tools use to rebuild nesting (``_EmptyStateDictLoadPlanner``,
``load_sharded_optimizer_state_dict``). A planner whose data is anything else keeps it to itself.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptmgr.codec.layout import check_file_name
from ckptmgr.codec.manifest import ManifestError, UnsafePathError, check_json_depth
from ckptmgr.codec.values import NotRepresentableError, decode_tagged, encode_tagged
from ckptmgr.dcp._lazy_metadata import (
    ChunkTable,
    Column,
    ColumnarLocations,
    GridChunks,
    ItemLocation,
    TensorLocations,
)

__all__ = ["ENCODINGS", "ItemLocation", "decode_metadata", "dtype_name", "encode_metadata"]

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


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def _dtype(name: Any) -> torch.dtype:
    if not isinstance(name, str) or not name.isidentifier():
        raise ManifestError(f"bad dtype {name!r}")
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ManifestError(f"unknown dtype {name!r}")
    return dt


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


def _encode_v1(md: Metadata) -> bytes:
    """Format 1: ``md`` (``storage_data``: MetadataIndex -> ItemLocation) as one JSON document."""
    tensors: dict[str, Any] = {}
    values: list[str] = []
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, TensorStorageMetadata):
            tensors[fqn] = {
                "dtype": dtype_name(sm.properties.dtype),
                "size": list(sm.size),
                "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)}
                           for c in sm.chunks],
            }
        else:
            values.append(fqn)
    storage = []
    for idx, loc in (md.storage_data or {}).items():
        storage.append({
            "fqn": idx.fqn, "offset": None if idx.offset is None else list(idx.offset),
            "file": loc.file, "pos": loc.offset, "length": loc.length,
            "checksum": loc.checksum, "enc": loc.enc,
        })
    doc: dict[str, Any] = {"format": FORMAT, "version": 1, "dcp_version": md.version,
                           "tensors": tensors, "values": values, "storage": storage}
    paths = _planner_paths(md.planner_data)
    if paths is not None:
        doc["planner_data"] = paths
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


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


def _decode_v1(data: bytes) -> Metadata:
    """Format 1 (one JSON document)."""
    if len(data) <= _DEPTH_PRESCAN_BYTES:
        check_json_depth(data, 16)
    try:
        doc = json.loads(data.decode("utf-8"))
    except RecursionError as e:
        # json's C parser counts its nesting against the recursion limit (it never overflows
        # the C stack), so a deep document fails here; the schema below rejects the rest.
        raise ManifestError("metadata JSON is nested too deeply") from e
    except ValueError as e:  # also UnicodeDecodeError, and ints of over 4300 digits
        raise ManifestError(f"metadata is not valid JSON: {e}"[:300]) from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError("not ckptmgr DCP metadata")
    if doc.get("version") != 1:
        raise ManifestError(f"metadata version {doc.get('version')!r} is not supported by this "
                            "ckptmgr (it reads versions 1 and 2): upgrade ckptmgr")
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
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
        chunks = []
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
            chunks.append(ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes)))
        if len(chunks) != 1 or flat != [0] * len(size) + list(size):  # one whole chunk: fine
            _check_chunks(fqn, size, torch.tensor(flat, dtype=torch.int64).view(
                len(chunks), 2, len(size)))
        sdm[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=_dtype(t.get("dtype"))), torch.Size(size), chunks)
    for fqn in values:
        if not isinstance(fqn, str) or fqn in sdm:
            raise ManifestError(f"bad or repeated value key {fqn!r}"[:300])
        sdm[fqn] = BytesStorageMetadata()
    storage_data: dict[MetadataIndex, ItemLocation] = {}
    for s in storage:
        if not isinstance(s, dict) or not isinstance(s.get("fqn"), str):
            raise ManifestError("bad storage entry")
        fqn = s["fqn"]
        if fqn not in sdm:
            raise ManifestError(f"storage entry for unknown key {fqn!r}")
        off = s.get("offset")
        idx = MetadataIndex(fqn, None if off is None else _ints(off, f"{fqn} offset"))
        try:
            file = check_file_name(s.get("file"))  # type: ignore[arg-type]
        except ValueError as e:
            raise UnsafePathError(
                f"storage path of {fqn!r} escapes the step directory: {e}") from e
        pos, length = _ints([s.get("pos"), s.get("length")], f"{fqn} position")
        is_value = isinstance(sdm[fqn], BytesStorageMetadata)
        if (s.get("enc") not in (_VALUE_ENCODINGS if is_value else ENCODINGS)
                or not isinstance(s.get("checksum"), str) or is_value != (off is None)):
            raise ManifestError(f"bad encoding, checksum or offset for {fqn!r}")
        storage_data[idx] = ItemLocation(file, pos, length, s["checksum"], s["enc"])
    dcp_version = doc.get("dcp_version")
    planner_data = (_decode_planner_paths(doc["planner_data"]) if doc.get("planner_data")
                    is not None else None)
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage_data,
                    version=dcp_version if isinstance(dcp_version, str) else None)


# ---------------------------------------------------------------------------------------------
# Chunks: inside the tensor, covering it exactly once. A restore reads only the chunks that
# overlap what it loads, so a chunk listed twice (or a gap) would leave part of the destination
# as it was, silently; bounds are compared, never added (2**62 + 2**62 wraps in int64).


def _outside(fqn: str) -> ManifestError:
    return ManifestError(f"chunk of {fqn!r} lies outside the tensor")


def _not_once(fqn: str, why: str) -> ManifestError:
    return ManifestError(f"chunks of {fqn!r} do not cover the tensor exactly once: {why}")


# Chunk tables that passed the check, by (size, table bytes): a writer emits the same table for
# every tensor of one shape and sharding, so a state of 10k tensors has a handful of distinct
# tables and each is checked once. Bounded; cleared when full.
_CHECKED: dict[tuple[tuple[int, ...], bytes], None] = {}
_MAX_CHECKED = 4096


def _check_chunks(fqn: str, size: tuple[int, ...], box: torch.Tensor) -> None:
    """:func:`_check_chunk_table`, once per distinct (size, table)."""
    key = (tuple(size), box.contiguous().numpy().tobytes())
    if key in _CHECKED:
        return
    _check_chunk_table(fqn, size, box)
    if len(_CHECKED) >= _MAX_CHECKED:
        _CHECKED.clear()
    _CHECKED[key] = None


def _check_chunk_table(fqn: str, size: tuple[int, ...], box: torch.Tensor) -> None:
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
    limit = torch.tensor(size, dtype=torch.int64)
    if bool((offs > limit).any()) or bool((lens > limit - offs).any()):
        raise _outside(fqn)
    if math.prod(size) == 0:
        return  # no element to cover: every chunk is empty
    full = (lens > 0).all(dim=1)
    offs, lens = offs[full], lens[full]
    if offs.shape[0] == 0:
        raise _not_once(fqn, "no chunk holds any of its elements")
    # Only the dimensions some chunk does not span whole matter (the others add nothing).
    split = ((offs != 0) | (lens != limit)).any(dim=0).nonzero().flatten().tolist()
    if not split:
        if offs.shape[0] > 1:
            raise _not_once(fqn, f"{offs.shape[0]} chunks each hold the whole tensor")
        return
    lo = offs[:, split].contiguous()
    hi = lo + lens[:, split]  # no overflow: hi <= size
    dims = [size[d] for d in split]
    if len(split) == 1:
        _check_intervals(fqn, split[0], dims[0], lo[:, 0], hi[:, 0])
    elif not _is_product_tiling(lo, hi, dims):
        _check_corner_parity(fqn, lo, hi, dims)


def _check_intervals(fqn: str, dim: int, length: int, lo: torch.Tensor,
                     hi: torch.Tensor) -> None:
    """Non-empty intervals [lo, hi) tile [0, length) exactly once: sorted, each starts where
    the previous one ends."""
    order = torch.argsort(lo)
    lo, hi = lo[order], hi[order]
    if int(lo[0]) != 0:
        raise _not_once(fqn, f"no chunk holds [0, {int(lo[0])}) of dimension {dim}")
    bad = (lo[1:] != hi[:-1]).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        a, b = int(hi[i]), int(lo[i + 1])
        if b < a:
            raise _not_once(fqn, f"chunks at {int(lo[i])} and {b} of dimension {dim} overlap")
        raise _not_once(fqn, f"no chunk holds [{a}, {b}) of dimension {dim}")
    if int(hi[-1]) != length:
        raise _not_once(fqn, f"no chunk holds [{int(hi[-1])}, {length}) of dimension {dim}")


def _is_product_tiling(lo: torch.Tensor, hi: torch.Tensor, dims: list[int]) -> bool:
    """Whether the non-empty boxes are exactly the cells of a grid: along each dimension their
    extents are the pieces of one partition (each box spans from a start to the next start),
    and the boxes fall in distinct cells, as many as there are cells (so each cell once).
    False says nothing (an irregular layout may still be exact). 1-d sorts only: fast."""
    n = lo.shape[0]
    cells = 1
    cell = torch.zeros(n, dtype=torch.int64)
    for j, length in enumerate(dims):
        starts = torch.unique(lo[:, j])  # sorted
        if int(starts[0]) != 0:
            return False
        where = torch.searchsorted(starts, lo[:, j].contiguous())
        ends = torch.cat([starts[1:], torch.tensor([length], dtype=torch.int64)])
        if not bool((hi[:, j] == ends[where]).all()):
            return False
        cells *= starts.shape[0]
        if cells > n:
            return False
        cell = cell * starts.shape[0] + where  # < cells <= n: no overflow
    return cells == n and torch.unique(cell).shape[0] == n


def _check_corner_parity(fqn: str, lo: torch.Tensor, hi: torch.Tensor, dims: list[int]) -> None:
    """Exact cover by corner parity. A box's indicator is the signed sum of the orthants at its
    2**k corners, and orthants at distinct points are independent (mod 2 too): so the boxes
    cover every element an odd number of times (and nothing outside, as they lie inside) exactly
    when the corners that occur an odd number of times are the tensor's own 2**k corners. Odd
    cover everywhere plus volumes adding up to the tensor's elements is cover exactly once."""
    n, k = lo.shape
    if n << k > _MAX_CORNERS:
        raise _not_once(fqn, f"{n} chunks split {k} dimensions irregularly, more than this "
                        "reader checks")
    volumes = (hi - lo).prod(dim=1)  # each <= the tensor's elements: no overflow
    # Summed in two halves of 31 bits so that overlapping boxes cannot wrap the int64 sum.
    total = (int((volumes >> 31).sum()) << 31) + int((volumes & ((1 << 31) - 1)).sum())
    numel = math.prod(dims)
    if total != numel:
        how = "overlap" if total > numel else "leave a gap"
        raise _not_once(fqn, f"they hold {total} of its {numel} elements (chunks {how})")
    # Coordinates ranked per dimension, so that a corner is one int64 key (1-d sorts are fast).
    lo_rank, hi_rank, counts = [], [], []
    for j, length in enumerate(dims):
        coords, rank = torch.unique(torch.cat([lo[:, j], hi[:, j]]), return_inverse=True)
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
        key = torch.zeros(n, dtype=torch.int64)
        for j in range(k):
            key = key * counts[j] + (hi_rank[j] if (mask >> j) & 1 else lo_rank[j])
        keys.append(key)
    points, times = torch.unique(torch.cat(keys), return_counts=True)
    odd = set(points[times % 2 == 1].tolist())
    own = set()
    for mask in range(1 << k):
        corner = 0
        for j in range(k):
            corner = corner * counts[j] + (counts[j] - 1 if (mask >> j) & 1 else 0)
        own.add(corner)
    if odd != own:
        raise _not_once(fqn, "some elements are in two chunks and others in none")


def encode_metadata(md: Metadata, *, version: int = VERSION) -> bytes:
    """``md`` (``storage_data``: MetadataIndex -> ItemLocation, or None) as metadata bytes:
    format 2 unless ``version=1`` is asked for or the metadata does not fit format 2 (module
    docstring), then format 1."""
    if version not in VERSIONS:
        raise ValueError(f"metadata version must be one of {VERSIONS}, got {version!r}")
    if version == 2:
        out = _encode_v2(md)
        if out is not None:
            return out
    return _encode_v1(md)


def decode_metadata(data: bytes) -> Metadata:
    """Rebuild DCP ``Metadata`` from :func:`encode_metadata` bytes (either format).

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
_MASK64 = (1 << 64) - 1


class _NotColumnar(Exception):
    """The metadata does not fit format 2: written as format 1."""


def _as_tensor(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(torch.int64).contiguous()
    return torch.tensor(values, dtype=torch.int64)


def _column_spec(values: Sequence[int] | torch.Tensor, body: bytearray, *,
                 arithmetic: bool = True) -> dict[str, Any]:
    """The cheapest description of an int64 column: constant, arithmetic run, runs, packed."""
    t = _as_tensor(values)
    n = t.numel()
    if n == 0:
        return {"c": 0}
    first = int(t[0])
    if n == 1 or bool((t == first).all()):
        return {"c": first}
    if arithmetic:
        step = int(t[1]) - first
        if bool((t == first + torch.arange(n, dtype=torch.int64) * step).all()):
            return {"a": [first, step]}
    change = (t[1:] != t[:-1]).nonzero().flatten()
    if change.numel() < _MAX_RUNS:
        ends = [*(change + 1).tolist(), n]
        starts = [0, *ends[:-1]]
        return {"r": [[int(t[s]) for s in starts], ends]}
    body.extend(b"\0" * (-len(body) % 8))
    offset = len(body)
    body.extend(ctypes.string_at(t.data_ptr(), 8 * n))
    return {"q": offset}


def _grid_of(size: tuple[int, ...], chunks: Sequence[ChunkStorageMetadata]) -> GridChunks | None:
    """``chunks`` as a :class:`GridChunks` when they are exactly one, else None."""
    if isinstance(chunks, GridChunks):
        return chunks
    n, nd = len(chunks), len(size)
    if nd == 0:
        return GridChunks(size, 0, 1, 1) if n == 1 else None
    if n == 0 or any(chunks[0].offsets):
        return None
    if n == 1:
        partial = [j for j in range(nd) if chunks[0].sizes[j] != size[j]]
        if len(partial) > 1:
            return None
        dim = partial[0] if partial else 0
        step = max(1, chunks[0].sizes[dim])
    else:
        moved = [j for j in range(nd) if chunks[1].offsets[j]]
        if len(moved) != 1:
            return None
        dim = moved[0]
        step = chunks[1].offsets[dim]
    grid = GridChunks(size, dim, step, n)
    if n > -(-size[dim] // step) + 1:
        return None
    for i, c in enumerate(chunks):
        offsets, sizes = grid.box(i)
        if tuple(c.offsets) != offsets or tuple(c.sizes) != sizes:
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


def _encode_v2(md: Metadata) -> bytes | None:
    try:
        return _encode_v2_or_raise(md)
    except _NotColumnar:
        return None


def _encode_v2_or_raise(md: Metadata) -> bytes:
    storage: Mapping[MetadataIndex, Any] | None = md.storage_data
    columnar = storage if isinstance(storage, ColumnarLocations) else None
    # Plain dicts: group the locations by key, then by chunk offsets (one pass).
    by_key: dict[str, dict[tuple[int, ...] | None, Any]] = {}
    if storage and columnar is None:
        for idx, loc in storage.items():
            by_key.setdefault(idx.fqn, {})[
                None if idx.offset is None else tuple(idx.offset)] = loc
    files: dict[str, int] = {}
    if columnar is not None:
        files = {f: i for i, f in enumerate(columnar.files)}
    prefix: str | None = None
    body = bytearray()
    tensors: list[dict[str, Any]] = []
    values: list[list[Any]] = []
    for fqn, sm in md.state_dict_metadata.items():
        if not isinstance(sm, TensorStorageMetadata):
            continue
        size = tuple(int(s) for s in sm.size)
        entry: dict[str, Any] = {"fqn": fqn, "dtype": dtype_name(sm.properties.dtype),
                                 "size": list(size)}
        grid = _grid_of(size, sm.chunks)
        chunks: GridChunks | ChunkTable
        if grid is not None:
            chunks = grid
            entry["grid"] = [grid.dim, grid.step, grid.num_chunks]
        else:
            nd = len(size)
            flat = [x for c in sm.chunks for x in (*c.offsets, *c.sizes)]
            if len(flat) != 2 * nd * len(sm.chunks):
                raise _NotColumnar
            chunks = ChunkTable(size, len(sm.chunks), Column.packed(flat))
            entry["count"] = len(sm.chunks)
            entry["table"] = _column_spec(flat, body)
        tensors.append(entry)
        if columnar is not None:
            t = columnar.tensors.get(fqn)
            if t is None or t.chunks != chunks:
                raise _NotColumnar
            if prefix is not None and t.prefix != prefix:
                raise _NotColumnar
            prefix = t.prefix
            entry["loc"] = {"file": _column_spec(t.file.to_tensor(), body),
                            "pos": _column_spec(t.pos.to_tensor(), body),
                            "sum": _column_spec(t.checksum.to_tensor(), body, arithmetic=False)}
            continue
        locs = by_key.pop(fqn, None)
        if locs is None:
            if storage:
                raise _NotColumnar  # a tensor without stored bytes: format 1 says so as it is
            continue
        if len(locs) != len(chunks):
            raise _NotColumnar
        itemsize = sm.properties.dtype.itemsize
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
    value_locs: Mapping[MetadataIndex, Any] = (
        columnar.value_locations if columnar is not None else
        {MetadataIndex(k): v[None] for k, v in by_key.items() if None in v})
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, TensorStorageMetadata):
            continue
        loc = value_locs.get(MetadataIndex(fqn))
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
        "format": FORMAT, "version": 2, "dcp_version": md.version, "byteorder": sys.byteorder,
        "files": list(files), "checksum_prefix": prefix or "", "tensors": tensors,
        "values": values, "has_storage": storage is not None}
    paths = _planner_paths(md.planner_data)
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
            t = col.to_tensor()
            ends = [int(t.min()), int(t.max())]
        else:
            ends = []
    else:
        raise ManifestError(f"bad column kind {kind!r} for {what}"[:300])
    if ends and (min(ends) < lo or max(ends) >= hi):
        raise ManifestError(f"a value of {what} is out of range")
    return col


def _table(spec: Any, fqn: str, size: tuple[int, ...], count: int, body: _Body) -> ChunkTable:
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
    _check_chunks(fqn, size, col.to_tensor().view(count, 2, nd))
    return ChunkTable(size, count, col)


def _grid(g: Any, fqn: str, size: tuple[int, ...]) -> GridChunks:
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
    return GridChunks(size, dim, step, count)


def _swap_body(body: bytearray) -> None:
    """Packed columns written on a host of the other byte order, in place."""
    if len(body) < 8:
        return
    t = torch.frombuffer(body, dtype=torch.uint8)[:len(body) // 8 * 8].view(-1, 8)
    t.copy_(t.flip(1))


def _decode_v2(data: bytes) -> Metadata:
    if len(data) < 16:
        raise ManifestError("metadata header is truncated")
    hlen = int.from_bytes(data[8:16], "little")
    if 16 + hlen > len(data):
        raise ManifestError("metadata header lies outside the file")
    head = bytes(data[16:16 + hlen])
    if len(head) <= _DEPTH_PRESCAN_BYTES:
        check_json_depth(head, 16)
    try:
        doc = json.loads(head.decode("utf-8"))
    except RecursionError as e:
        raise ManifestError("metadata JSON is nested too deeply") from e
    except ValueError as e:  # also UnicodeDecodeError, and ints of over 4300 digits
        raise ManifestError(f"metadata header is not valid JSON: {e}"[:300]) from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError("not ckptmgr DCP metadata")
    if doc.get("version") != 2:
        raise ManifestError(f"metadata version {doc.get('version')!r} is not supported by this "
                            "ckptmgr (it reads versions 1 and 2): upgrade ckptmgr")
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
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    locs: dict[str, TensorLocations] = {}
    num_chunks = 0
    for t in tensors:
        if not isinstance(t, dict) or not isinstance(t.get("fqn"), str):
            raise ManifestError("bad tensor entry")
        fqn = t["fqn"]
        if fqn in sdm:
            raise ManifestError(f"tensor {fqn!r} appears twice")
        size = _size(t.get("size"), fqn)
        dtype = _dtype(t.get("dtype"))
        chunks: GridChunks | ChunkTable
        if "grid" in t:
            chunks = _grid(t["grid"], fqn, size)
        else:
            chunks = _table(t.get("table"), fqn, size, _int(t.get("count"), f"{fqn} count"),
                            body)
        num_chunks += len(chunks)
        if num_chunks > _MAX_CHUNKS:
            raise ManifestError(f"the metadata lists over {_MAX_CHUNKS} chunks (at {fqn!r}), "
                                "more than this reader accepts")
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size),
                                         cast(list[ChunkStorageMetadata], chunks))
        loc = t.get("loc")
        if loc is None:
            continue
        if not isinstance(loc, dict):
            raise ManifestError(f"bad locations for {fqn!r}")
        n = len(chunks)
        locs[fqn] = TensorLocations(
            chunks, dtype.itemsize,
            _column(loc.get("file"), n, body, f"{fqn} files", lo=0, hi=len(files)),
            _column(loc.get("pos"), n, body, f"{fqn} positions", lo=0),
            _column(loc.get("sum"), n, body, f"{fqn} checksums"), prefix)
    value_locs: dict[MetadataIndex, ItemLocation] = {}
    for v in values:
        if not isinstance(v, list) or not v or not isinstance(v[0], str) or v[0] in sdm:
            raise ManifestError(f"bad value entry {v!r}"[:200])
        fqn = v[0]
        sdm[fqn] = BytesStorageMetadata()
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
        value_locs[MetadataIndex(fqn)] = ItemLocation(files[fi], pos, length, v[4], v[5])
    dcp_version = doc.get("dcp_version")
    planner_data = (_decode_planner_paths(doc["planner_data"]) if doc.get("planner_data")
                    is not None else None)
    storage_data = (ColumnarLocations(files, locs, value_locs) if doc.get("has_storage")
                    else None)
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage_data,
                    version=dcp_version if isinstance(dcp_version, str) else None)
