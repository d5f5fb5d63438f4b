"""The metadata encoder's shortcuts for a tensor of one whole chunk (format 2,
``ckptmgr.codec.metadata_columnar``) against its general path, on drawn metadata, well-formed and
not: the same bytes, the same fallback to format 1, or the same exception. A review found inputs
where an earlier version of the shortcuts wrote format 2 for metadata the general path sends to
format 1 (offsets of another rank than the tensor's, negative sizes); this keeps drawing them.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from _fuzz import fuzz_settings
from hypothesis import example, given
from hypothesis import strategies as st

from ckptmgr.codec import metadata_columnar
from ckptmgr.codec.chunks import BoxList, GridBoxes
from ckptmgr.codec.metadata import ItemLocation, MetadataDoc, TensorEntry


class _Listed(BoxList):
    """A chunk list the shortcuts do not recognise: the general path encodes it."""


def _as(kind: str, xs: list[int]) -> Any:
    if kind == "list":
        return list(xs)
    if kind == "size":
        return torch.Size(xs)
    if kind == "float":
        return tuple(float(x) for x in xs)
    return tuple(xs)


@st.composite
def _tensor(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[Any, Any]] | GridBoxes]:
    nd = draw(st.integers(0, 3))
    size = tuple(draw(st.lists(st.integers(-2, 6), min_size=nd, max_size=nd)))
    mode = draw(st.sampled_from(["whole", "whole", "part", "offset", "rank", "grid", "many"]))
    if mode == "grid":
        dim = draw(st.integers(0, max(0, nd - 1)))
        return size, GridBoxes(size, dim, draw(st.integers(0, 8)), draw(st.integers(0, 3)))
    kinds = st.sampled_from(["tuple", "tuple", "list", "size", "float"])
    boxes = []
    for _ in range(draw(st.integers(2, 3)) if mode == "many" else 1):
        if mode == "whole":
            off, sz = [0] * nd, list(size)
        elif mode == "rank":  # offsets and sizes of another rank than the tensor's
            k = draw(st.integers(0, 4))
            off, sz = [0] * k, (list(size) if draw(st.booleans()) else [0] * k)
        else:
            off = [draw(st.integers(0, 3)) if mode == "offset" else 0 for _ in range(nd)]
            sz = [draw(st.integers(-1, 6)) for _ in range(nd)]
        boxes.append((_as(draw(kinds), off), _as(draw(kinds), sz)))
    return size, boxes


@st.composite
def _doc_parts(draw: st.DrawFn) -> tuple[list[Any], str]:
    tensors = []
    pos = 0
    for i in range(draw(st.integers(1, 4))):
        size, chunks = draw(_tensor())
        locs = {}
        for o, s in chunks:  # a grid's boxes, or the listed ones
            key = tuple(o)
            if draw(st.integers(0, 9)) == 0:  # a location keyed elsewhere
                key = tuple(0 for _ in range(draw(st.integers(0, 3))))
            try:
                n = math.prod(s) * 4
            except TypeError:
                n = 0
            if draw(st.integers(0, 9)) == 0:  # a length that does not fit the chunk
                n = draw(st.integers(-8, 64))
            locs[(f"t{i}", key)] = ItemLocation(f"data-{i % 2}.bin", pos, int(n),
                                                f"xxh3_64:{pos:016x}", "raw")
            pos += 4
        tensors.append((size, chunks, locs))
    return tensors, draw(st.sampled_from(["dict", "dict", "none", "empty"]))


def _doc(parts: tuple[list[Any], str], listed: type[BoxList]) -> MetadataDoc:
    tensors, storage_kind = parts
    entries: dict[str, TensorEntry] = {}
    storage: dict[Any, ItemLocation] = {}
    for i, (size, chunks, locs) in enumerate(tensors):
        boxes = chunks if isinstance(chunks, GridBoxes) else listed(size, chunks)
        entries[f"t{i}"] = TensorEntry("float32", size, boxes)
        storage.update(locs)
    kept = storage if storage_kind == "dict" else None if storage_kind == "none" else {}
    return MetadataDoc(entries, [], kept)


def _outcome(doc: MetadataDoc) -> tuple[str, Any]:
    try:
        return "ok", metadata_columnar.encode_columnar_metadata(doc)
    except Exception as e:  # the same failure either way is what is compared
        return "raised", type(e).__name__


# One chunk of a grid over a negative size (its box starts at -1): not the whole tensor.
_NEGATIVE = ((-1, 2), GridBoxes((-1, 2), 0, 3, 1), {
    ("t0", (-1, 0)): ItemLocation("data-0.bin", 0, 0, "xxh3_64:0000000000000000", "raw")})


@fuzz_settings(300)
@given(_doc_parts())
@example(([_NEGATIVE], "dict"))
def test_the_shortcuts_encode_as_the_general_path(parts: tuple[list[Any], str]) -> None:
    fast = _outcome(_doc(parts, BoxList))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(metadata_columnar, "_whole_chunk", lambda grid, size: False)
        general = _outcome(_doc(parts, _Listed))
    assert fast == general
