"""Shared chunks in the codec (issue 30): the one path form outside a step directory, and the
manifest of format version 2 that lists them (pure, no torch)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ckptmgr.codec.checksum import content_digest
from ckptmgr.codec.layout import (
    check_stored_name,
    is_shared_chunk_name,
    is_shared_chunk_path,
    is_shared_temp_name,
    shared_chunk_digest,
    shared_chunk_path,
    shared_temp_path,
)
from ckptmgr.codec.manifest import (
    FileEntry,
    Manifest,
    ManifestError,
    UnsafePathError,
    decode_manifest,
    encode_manifest,
    utc_now_iso,
)
from ckptmgr.codec.metadata_file import parse_metadata

HEX = "0123456789abcdef" * 2
SUM = "xxh3_64:" + "1" * 16


def test_names() -> None:
    assert content_digest(b"abc") == content_digest(memoryview(b"abc")) != content_digest(b"")
    assert len(content_digest(b"abc")) == 32
    path = shared_chunk_path(HEX)
    assert path == f"chunks/{HEX}" and is_shared_chunk_path(path)
    assert shared_chunk_digest(path) == HEX
    assert is_shared_chunk_name(HEX) and not is_shared_chunk_name(HEX.upper())
    assert is_shared_temp_name(shared_temp_path(HEX, "0" * 12).split("/", 1)[1])
    assert not is_shared_chunk_path(shared_temp_path(HEX, "0" * 12))
    with pytest.raises(ValueError):
        shared_chunk_path("xyz")


@pytest.mark.parametrize("name", [f"chunks/{HEX}", "data-0123456789ab-r00000-000.bin"])
def test_stored_names_accepted(name: str) -> None:
    assert check_stored_name(name) == name


@pytest.mark.parametrize("name", [
    f"chunks/{HEX.upper()}", f"chunks/{HEX}0", f"chunks/{HEX[:-1]}", f"../chunks/{HEX}",
    f"/chunks/{HEX}", f"chunks/x/{HEX}", f"chunks/../{HEX}", "chunks/", f"x/chunks/{HEX}",
    f"chunks/{HEX}.tmp-0123456789ab", "a/b", "..", ""])
def test_stored_names_refused(name: str) -> None:
    with pytest.raises(ValueError):
        check_stored_name(name)


def _manifest(**kw: Any) -> Manifest:
    md = "metadata-0123456789ab.json"
    base: dict[str, Any] = dict(
        step=3, time=utc_now_iso(), attempt="0123456789ab", world_size=1, metadata_file=md,
        files=(FileEntry(md, 10, SUM),), bytes_per_rank={0: 10}, versions={"ckptmgr": "x"},
        format_version=2, shared=(FileEntry(f"chunks/{HEX}", 4096, SUM),))
    base.update(kw)
    return Manifest(**base)


def test_version_2_round_trip() -> None:
    m = _manifest()
    doc = json.loads(encode_manifest(m))
    assert doc["format_version"] == 2 and doc["shared_bytes"] == 4096
    assert doc["total_bytes"] == 10  # the step's own files
    back = decode_manifest(encode_manifest(m), expected_step=3)
    assert back == m and back.shared_bytes == 4096 and back.total_bytes == 10
    assert back.file(f"chunks/{HEX}").size == 4096
    one = _manifest(format_version=1, shared=())
    assert "shared" not in json.loads(encode_manifest(one))


def _edited(edit: Any) -> bytes:
    doc = json.loads(encode_manifest(_manifest()))
    edit(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(("edit", "error"), [
    (lambda d: d["shared"][0].update(path=f"../chunks/{HEX}"), UnsafePathError),
    (lambda d: d["shared"][0].update(path=f"chunks/x/{HEX}"), UnsafePathError),
    (lambda d: d["shared"][0].update(path="data-0123456789ab-r00000-000.bin"), UnsafePathError),
    (lambda d: d["files"].append({"path": f"chunks/{HEX}", "size": 1, "checksum": SUM}),
     UnsafePathError),
    (lambda d: d.update(format_version=1), ManifestError),
    (lambda d: d.update(format_version=3), ManifestError),
    (lambda d: d.pop("shared"), ManifestError),
    (lambda d: d["shared"].append(dict(d["shared"][0])), ManifestError),
    (lambda d: d.update(shared_bytes=1), ManifestError),
    (lambda d: d["shared"][0].update(size=-1), ManifestError),
    (lambda d: d["shared"][0].update(checksum="md5:0"), ManifestError),
])
def test_version_2_refused(edit: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        decode_manifest(_edited(edit))


def test_metadata_may_name_a_shared_chunk() -> None:
    """A format-1 metadata file whose item lives in a shared chunk decodes; one naming a path
    out of the step in any other form is an UnsafePathError."""
    def doc(file: str) -> bytes:
        return json.dumps({
            "format": "ckptmgr-dcp-metadata", "version": 1, "dcp_version": None,
            "tensors": {"w": {"dtype": "float32", "size": [4],
                              "chunks": [{"offsets": [0], "sizes": [4]}]}},
            "values": [],
            "storage": [{"fqn": "w", "offset": [0], "file": file, "pos": 0, "length": 16,
                         "checksum": SUM, "enc": "raw"}]}).encode()

    md = parse_metadata(doc(f"chunks/{HEX}"))
    assert md is not None
    with pytest.raises(UnsafePathError):
        parse_metadata(doc(f"chunks/../{HEX}"))
