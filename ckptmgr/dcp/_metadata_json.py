"""DCP ``Metadata`` as JSON and back, so reading a checkpoint never runs pickle.

The encoding holds what loading needs: per key, tensor dtype, global size and stored chunks, or a
marker for an encoded Python value; and per stored item, where its bytes are (file, offset, length),
their checksum and encoding. Decoding validates every field and every path.

Optional, when the save planner flattened a nested state dict (DCP's default planners do):
``planner_data``, each flat key's path in the nested dict (tagged JSON: str keys and int list
indices), which DCP's own tools use to rebuild nesting (``_EmptyStateDictLoadPlanner``,
``load_sharded_optimizer_state_dict``). A planner whose data is anything else keeps it to itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptmgr._values import NotRepresentableError, decode_tagged, encode_tagged
from ckptmgr.layout import check_file_name
from ckptmgr.manifest import ManifestError, UnsafePathError, check_json_depth

__all__ = ["ENCODINGS", "ItemLocation", "decode_metadata", "dtype_name", "encode_metadata"]

ENCODINGS = ("raw", "json", "pickle")
FORMAT = "ckptmgr-dcp-metadata"
VERSION = 1
MAX_METADATA_BYTES = 1 << 30
# Larger metadata skips the depth pre-scan, which runs byte by byte in Python above 1 MiB (about
# 0.1 s per MiB: most of the decode time of a 16k-rank step); the parser bounds the depth itself.
_DEPTH_PRESCAN_BYTES = 1 << 20


@dataclass(frozen=True)
class ItemLocation:
    """Where one stored item's bytes are, inside the step directory."""

    file: str
    offset: int
    length: int
    checksum: str
    enc: str  # "raw" tensor bytes, "json" tagged JSON value, "pickle" torch.save bytes


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
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ManifestError(f"{what} must be a list of ints >= 0, got {v!r}")
    return v


def encode_metadata(md: Metadata) -> bytes:
    """``md`` (with ``storage_data`` mapping MetadataIndex -> ItemLocation) as JSON bytes."""
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
    doc: dict[str, Any] = {"format": FORMAT, "version": VERSION, "dcp_version": md.version,
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


def decode_metadata(data: bytes) -> Metadata:
    """Rebuild DCP ``Metadata`` from :func:`encode_metadata` bytes.

    Raises:
        ManifestError: the bytes are not valid metadata (bad JSON, field, dtype or path).
    """
    if len(data) > MAX_METADATA_BYTES:
        raise ManifestError(f"metadata is {len(data)} bytes, over the limit")
    if len(data) <= _DEPTH_PRESCAN_BYTES:
        check_json_depth(data, 16)
    try:
        doc = json.loads(data.decode("utf-8"))
    except RecursionError as e:
        # json's C parser counts its nesting against the recursion limit (it never overflows
        # the C stack), so a deep document fails here; the schema below rejects the rest.
        raise ManifestError("metadata JSON is nested too deeply") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestError(f"metadata is not valid JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError("not ckptmgr DCP metadata")
    if doc.get("version") != VERSION:
        raise ManifestError(f"metadata version {doc.get('version')!r} is not supported")
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
        size = _ints(t.get("size"), f"{fqn}.size")
        chunks = []
        for c in t["chunks"]:
            if not isinstance(c, dict):
                raise ManifestError(f"bad chunk for {fqn!r}")
            offs = _ints(c.get("offsets"), f"{fqn} chunk offsets")
            sizes = _ints(c.get("sizes"), f"{fqn} chunk sizes")
            if len(offs) != len(size) or len(sizes) != len(size) or any(
                    o + s > g for o, s, g in zip(offs, sizes, size, strict=True)):
                raise ManifestError(f"chunk of {fqn!r} lies outside the tensor")
            chunks.append(ChunkStorageMetadata(torch.Size(offs), torch.Size(sizes)))
        sdm[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=_dtype(t.get("dtype"))), torch.Size(size), chunks)
    for fqn in values:
        if not isinstance(fqn, str):
            raise ManifestError(f"bad value key {fqn!r}")
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
        if s.get("enc") not in ENCODINGS or not isinstance(s.get("checksum"), str):
            raise ManifestError(f"bad encoding or checksum for {fqn!r}")
        storage_data[idx] = ItemLocation(file, pos, length, s["checksum"], s["enc"])
    dcp_version = doc.get("dcp_version")
    planner_data = (_decode_planner_paths(doc["planner_data"]) if doc.get("planner_data")
                    is not None else None)
    return Metadata(state_dict_metadata=sdm, planner_data=planner_data, storage_data=storage_data,
                    version=dcp_version if isinstance(dcp_version, str) else None)
