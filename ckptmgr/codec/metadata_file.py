"""The DCP metadata file as bytes and back, torch-free, so reading a checkpoint never runs pickle.

:func:`parse_metadata` validates every field and every path and gives a
:class:`~ckptmgr.codec.metadata.MetadataDoc` of plain structures; :func:`serialize_metadata`
writes one. Two formats (docs/byte-format.md), both read here, told apart by their first bytes:

- **format 2** (:mod:`.metadata_columnar`, written since issue 18): a JSON header plus packed
  integer columns, decoded in O(tensors) into lazy chunk sequences and locations.
- **format 1** (:mod:`.metadata_json`): one JSON document with an object per chunk and per
  stored item; still written when the metadata does not fit format 2's model.

Optional, when the save planner flattened a nested state dict (DCP's default planners do):
``planner_data``, each flat key's path in the nested dict (tagged JSON: str keys and int list
indices), which DCP's own tools use to rebuild nesting (``_EmptyStateDictLoadPlanner``,
``load_sharded_optimizer_state_dict``). A planner whose data is anything else keeps it to itself.
"""

from __future__ import annotations

from ckptmgr.codec.manifest import ManifestError
from ckptmgr.codec.metadata import MetadataDoc
from ckptmgr.codec.metadata_columnar import (
    MAGIC,
    decode_columnar_metadata,
    encode_columnar_metadata,
)
from ckptmgr.codec.metadata_json import decode_json_metadata, encode_json_metadata

__all__ = ["MAX_METADATA_BYTES", "VERSION", "VERSIONS", "parse_metadata", "serialize_metadata"]

VERSION = 2
VERSIONS = (1, 2)
MAX_METADATA_BYTES = 1 << 30


def serialize_metadata(doc: MetadataDoc, *, version: int = VERSION) -> bytes:
    """``doc`` as metadata bytes: format 2 unless ``version=1`` is asked for or the metadata
    does not fit format 2 (:mod:`.metadata_columnar`), then format 1."""
    if version not in VERSIONS:
        raise ValueError(f"metadata version must be one of {VERSIONS}, got {version!r}")
    if version == 2:
        out = encode_columnar_metadata(doc)
        if out is not None:
            return out
    return encode_json_metadata(doc)


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
        return decode_columnar_metadata(data)
    return decode_json_metadata(data)
