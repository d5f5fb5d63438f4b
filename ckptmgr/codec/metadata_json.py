"""Metadata format 1: one JSON document with an object per chunk and per stored item.

O(ranks x tensors) objects, so format 2 (:mod:`.metadata_columnar`) is written wherever the
metadata fits its model; format 1 is still written when it does not (a tensor item not stored
raw, a checksum that is not ``<prefix><16 hex digits>``, a length other than the chunk's bytes),
and read for every checkpoint written before issue 18.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ckptmgr.codec.chunks import Box, BoxList, check_chunks, outside_tensor
from ckptmgr.codec.layout import check_stored_name
from ckptmgr.codec.manifest import ManifestError, UnsafePathError
from ckptmgr.codec.metadata import (
    ENCODINGS,
    FORMAT,
    VALUE_ENCODINGS,
    ItemLocation,
    MetadataDoc,
    StorageKey,
    TensorEntry,
    decode_planner_paths,
    encode_planner_paths,
    load_document,
    read_dtype,
    read_ints,
    read_size,
)

__all__ = ["decode_json_metadata", "encode_json_metadata"]


def encode_json_metadata(doc: MetadataDoc) -> bytes:
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
    paths = encode_planner_paths(doc.planner_data)
    if paths is not None:
        out["planner_data"] = paths
    return json.dumps(out, separators=(",", ":")).encode("utf-8")


def decode_json_metadata(data: bytes) -> MetadataDoc:
    """Format 1 (one JSON document)."""
    doc = load_document(data, 1, "metadata")
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
        size = read_size(t.get("size"), fqn)
        boxes: list[Box] = []
        flat: list[int] = []
        for c in t["chunks"]:
            if not isinstance(c, dict):
                raise ManifestError(f"bad chunk for {fqn!r}")
            offs = read_ints(c.get("offsets"), f"{fqn} chunk offsets")
            sizes = read_ints(c.get("sizes"), f"{fqn} chunk sizes")
            if len(offs) != len(size) or len(sizes) != len(size):
                raise outside_tensor(fqn)
            flat += offs
            flat += sizes
            boxes.append((tuple(offs), tuple(sizes)))
        if len(boxes) != 1 or flat != [0] * len(size) + list(size):  # one whole chunk: fine
            check_chunks(fqn, size, np.array(flat, dtype=np.int64).reshape(
                len(boxes), 2, len(size)))
        out[fqn] = TensorEntry(read_dtype(t.get("dtype")), size, BoxList(size, boxes))
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
        key = (fqn, None if off is None else tuple(read_ints(off, f"{fqn} offset")))
        try:
            file = check_stored_name(s.get("file"))  # type: ignore[arg-type]
        except ValueError as e:
            raise UnsafePathError(
                f"storage path of {fqn!r} escapes the step directory: {e}") from e
        pos, length = read_ints([s.get("pos"), s.get("length")], f"{fqn} position")
        is_value = fqn in is_values
        if (s.get("enc") not in (VALUE_ENCODINGS if is_value else ENCODINGS)
                or not isinstance(s.get("checksum"), str) or is_value != (off is None)):
            raise ManifestError(f"bad encoding, checksum or offset for {fqn!r}")
        storage_data[key] = ItemLocation(file, pos, length, s["checksum"], s["enc"])
    dcp_version = doc.get("dcp_version")
    planner_data = (decode_planner_paths(doc["planner_data"]) if doc.get("planner_data")
                    is not None else None)
    return MetadataDoc(out, value_keys, storage_data, planner_data,
                       dcp_version if isinstance(dcp_version, str) else None)
