"""DCP ``Metadata`` from and to the metadata file: the torch-facing side of
:mod:`ckptmgr.codec.metadata_file`, which decodes and validates the bytes into the plain
structures of :mod:`ckptmgr.codec.metadata`.

Format 2 decodes into compact chunk lists and locations (O(tensors) objects); here they become
what DCP's planners expect without expanding them: :class:`GridChunks` and :class:`ChunkTable`
are ``Sequence[ChunkStorageMetadata]`` that make a chunk only when asked, and
:class:`ColumnarLocations` is ``storage_data``, a ``Mapping`` from ``MetadataIndex`` to
:class:`~ckptmgr.codec.metadata.ItemLocation`. They compare equal to the plain lists and dicts
they stand for, and pickle as their compact columns (the coordinator broadcasts restore
metadata). :func:`find_chunk`, :func:`overlapping_chunks` and :func:`stored_volume` answer the
questions restores ask in O(1) or O(answer) for a grid, and by a scan for anything else.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast, overload

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptmgr.codec.chunks import Boxes, BoxList, BoxTable, GridBoxes
from ckptmgr.codec.manifest import Manifest, ManifestError
from ckptmgr.codec.metadata import (
    ColumnarStorage,
    ItemLocation,
    MetadataDoc,
    StorageKey,
    TensorEntry,
)
from ckptmgr.codec.metadata_file import VERSION, parse_metadata, serialize_metadata
from ckptmgr.errors import CorruptCheckpointError

__all__ = [
    "ChunkTable", "ColumnarLocations", "GridChunks", "decode_metadata", "dtype_name",
    "encode_metadata", "find_chunk", "from_doc", "metadata_from_doc", "overlapping_chunks",
    "stored_volume", "to_doc", "torch_dtype",
]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the metadata's name for it)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a metadata dtype name stands for.

    Raises:
        ManifestError: this torch has no such dtype.
    """
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ManifestError(f"unknown dtype {name!r}")
    return dt


class _ChunkSeq(Sequence[ChunkStorageMetadata]):
    """``md.chunks`` over compact :class:`~ckptmgr.codec.chunks.Boxes`: equality with any
    sequence of chunks, no hashing."""

    def __init__(self, boxes: GridBoxes | BoxTable) -> None:
        self.boxes = boxes

    @property
    def size(self) -> tuple[int, ...]:
        """The tensor's global size."""
        return self.boxes.size

    def __len__(self) -> int:
        return len(self.boxes)

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
        """Chunk ``i`` as DCP's object."""
        offsets, sizes = self.boxes.box(i)
        return ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if isinstance(other, _ChunkSeq):
            return self.boxes.same_boxes(other.boxes)
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.boxes,))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} chunks of {list(self.size)})"


class GridChunks(_ChunkSeq):
    """The chunks of a :class:`~ckptmgr.codec.chunks.GridBoxes` (a regular split of one
    dimension, FSDP2's ``Shard(0)``)."""

    boxes: GridBoxes


class ChunkTable(_ChunkSeq):
    """The chunks of a :class:`~ckptmgr.codec.chunks.BoxTable` (any other list)."""

    boxes: BoxTable


def _chunks(boxes: Boxes) -> Sequence[ChunkStorageMetadata]:
    if isinstance(boxes, GridBoxes):
        return GridChunks(boxes)
    if isinstance(boxes, BoxTable):
        return ChunkTable(boxes)
    return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in boxes]


def _boxes(size: tuple[int, ...], chunks: Sequence[ChunkStorageMetadata]) -> Boxes:
    if isinstance(chunks, _ChunkSeq):
        return chunks.boxes
    # torch.Size is a tuple of ints already: no per-element conversion (128k chunks: seconds)
    return BoxList(size, [(tuple(c.offsets), tuple(c.sizes)) for c in chunks])


class ColumnarLocations(Mapping[MetadataIndex, ItemLocation]):
    """``storage_data`` of format-2 metadata: ``MetadataIndex`` -> ``ItemLocation``, made on
    lookup from a :class:`~ckptmgr.codec.metadata.ColumnarStorage`."""

    def __init__(self, storage: ColumnarStorage) -> None:
        self.storage = storage

    def __getitem__(self, idx: MetadataIndex) -> ItemLocation:
        loc = self.storage.get(idx.fqn, idx.offset, idx.index)
        if loc is None:
            raise KeyError(idx)
        return loc

    def __contains__(self, idx: object) -> bool:
        if not isinstance(idx, MetadataIndex):
            return False
        return self.storage.get(idx.fqn, idx.offset, idx.index) is not None

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn, offsets, i in self.storage.entries():
            yield MetadataIndex(fqn, offsets, i)

    def __len__(self) -> int:
        return len(self.storage)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ColumnarLocations, (self.storage,))

    def __repr__(self) -> str:
        return f"ColumnarLocations({self.storage!r})"


def from_doc(doc: MetadataDoc) -> Metadata:
    """DCP ``Metadata`` for decoded metadata (O(tensors) for format 2: nothing is expanded).

    Raises:
        ManifestError: a dtype this torch does not have.
    """
    sdm: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, t in doc.tensors.items():
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch_dtype(t.dtype)),
                                         torch.Size(t.size), cast(list[ChunkStorageMetadata],
                                                                  _chunks(t.chunks)))
    for fqn in doc.values:
        sdm[fqn] = BytesStorageMetadata()
    storage_data: Mapping[MetadataIndex, ItemLocation] | None
    if isinstance(doc.storage, ColumnarStorage):
        storage_data = ColumnarLocations(doc.storage)
    elif doc.storage is not None:
        storage_data = {MetadataIndex(fqn, offsets): loc
                        for (fqn, offsets), loc in doc.storage.items()}
    else:
        storage_data = None
    return Metadata(state_dict_metadata=sdm, planner_data=doc.planner_data,
                    storage_data=storage_data, version=doc.dcp_version)


def metadata_from_doc(doc: MetadataDoc, manifest: Manifest) -> Metadata:
    """DCP ``Metadata`` for the decoded metadata file of ``manifest``'s checkpoint.

    Raises:
        CorruptCheckpointError: a dtype this torch does not have (names the file).
    """
    step, name = manifest.step, manifest.metadata_file
    try:
        return from_doc(doc)
    except ManifestError as e:
        raise CorruptCheckpointError(f"step {step}: {name}: {e}", step=step, path=name) from e


def to_doc(md: Metadata) -> MetadataDoc:
    """``md`` (``storage_data``: MetadataIndex -> ItemLocation, or None) as the codec's
    structures, for :func:`~ckptmgr.codec.metadata_file.serialize_metadata`."""
    tensors: dict[str, TensorEntry] = {}
    values: list[str] = []
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, TensorStorageMetadata):
            size = tuple(int(s) for s in sm.size)
            tensors[fqn] = TensorEntry(dtype_name(sm.properties.dtype), size,
                                       _boxes(size, sm.chunks))
        else:
            values.append(fqn)
    stored: Any = md.storage_data
    storage: ColumnarStorage | dict[StorageKey, ItemLocation] | None
    if isinstance(stored, ColumnarLocations):
        storage = stored.storage
    elif stored is None:
        storage = None
    else:
        storage = {(idx.fqn, None if idx.offset is None else tuple(idx.offset)): loc
                   for idx, loc in stored.items()}
    dcp_version = md.version if isinstance(md.version, str) else None
    return MetadataDoc(tensors, values, storage, md.planner_data, dcp_version)


def encode_metadata(md: Metadata, *, version: int = VERSION) -> bytes:
    """``md`` (``storage_data``: MetadataIndex -> ItemLocation, or None) as metadata bytes:
    format 2 unless ``version=1`` is asked for or the metadata does not fit format 2."""
    return serialize_metadata(to_doc(md), version=version)


def decode_metadata(data: bytes) -> Metadata:
    """Rebuild DCP ``Metadata`` from :func:`encode_metadata` bytes (either format).

    Raises:
        ManifestError: the bytes are not valid metadata (bad JSON, header, column, field, dtype
            or path).
        UnsafePathError: a data file name that leaves the step directory.
    """
    return from_doc(parse_metadata(data))


def find_chunk(chunks: Sequence[ChunkStorageMetadata], offsets: Sequence[int],
               hint: int | None = None) -> ChunkStorageMetadata | None:
    """The chunk of ``chunks`` at ``offsets`` (a lookup for compact sequences, a scan else)."""
    if isinstance(chunks, _ChunkSeq):
        i = chunks.boxes.index_of(offsets, hint)
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
    if isinstance(chunks, _ChunkSeq):
        return chunks.boxes.overlapping(offsets, sizes)
    size = tuple(len(offsets) * [0])
    return BoxList(size, [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]).overlapping(
        offsets, sizes)


def stored_volume(chunks: Sequence[ChunkStorageMetadata]) -> int:
    """Elements the chunks hold in total (O(1) for a :class:`GridChunks`)."""
    if isinstance(chunks, _ChunkSeq):
        return chunks.boxes.volume()
    return sum(math.prod(c.sizes) for c in chunks)
