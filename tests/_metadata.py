"""Tests that forge metadata edit it as a format-1 JSON document (which every reader still
reads): :func:`metadata_doc` turns the bytes of either format into that document."""

from __future__ import annotations

import json
from typing import Any

from ckptmgr.dcp.metadata import decode_metadata, encode_metadata


def metadata_doc(data: bytes) -> dict[str, Any]:
    """The format-1 JSON document of metadata ``data`` (format 1 or 2)."""
    doc: dict[str, Any] = json.loads(encode_metadata(decode_metadata(data), version=1))
    return doc
