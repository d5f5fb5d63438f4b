"""Step names, paths and the manifest: pure, no I/O."""

from __future__ import annotations

import json

import pytest

from ckptmgr.codec.layout import (
    check_relpath,
    data_file_name,
    new_attempt_id,
    parse_staging_name,
    parse_step_name,
    staging_dir_name,
)
from ckptmgr.codec.manifest import (
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    ManifestError,
    decode_manifest,
    encode_manifest,
    utc_now_iso,
)


@pytest.mark.parametrize("name,step", [("0", 0), ("7", 7), ("1000", 1000), ("00", None),
                                       ("07", None), ("-1", None), ("+1", None), ("1e3", None),
                                       ("", None), (" 1", None), ("1.0", None), ("\u0661", None),
                                       ("99999999999999999999", None)])
def test_parse_step_name(name: str, step: int | None) -> None:
    assert parse_step_name(name) == step


def test_staging_names() -> None:
    a = new_attempt_id()
    assert len(a) == 12 and a != new_attempt_id()
    assert parse_staging_name(staging_dir_name(12, a)) == (12, a)
    assert parse_staging_name("12") is None and parse_staging_name(".tmp-12-xyz") is None
    assert data_file_name(a, 3).startswith(f"data-{a}-r00003")


@pytest.mark.parametrize("bad", ["", "/etc/passwd", "../x", "a/../b", "a//b", "./a", "a\\b",
                                 "c:x", "a\x00"])
def test_check_relpath_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        check_relpath(bad)


def _manifest(**kw: object) -> Manifest:
    base: dict[str, object] = dict(
        step=5, time=utc_now_iso(), attempt="0123456789ab", world_size=1,
        metadata_file="metadata-0123456789ab.json",
        files=(FileEntry("metadata-0123456789ab.json", 10, "xxh3_64:" + "a" * 16),
               FileEntry("data-0123456789ab-r00000-000.bin", 100, "xxh3_64:" + "b" * 16)),
        bytes_per_rank={0: 110}, versions={"ckptmgr": "0.1.0"}, metrics={"loss": 1.5})
    base.update(kw)
    return Manifest(**base)  # type: ignore[arg-type]


def test_manifest_round_trip() -> None:
    m = _manifest()
    out = decode_manifest(encode_manifest(m), expected_step=5)
    assert out == m and out.total_bytes == 110


def _doc() -> dict[str, object]:
    return json.loads(encode_manifest(_manifest()))  # type: ignore[no-any-return]


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(format="other"), "not a ckptmgr manifest"),
    (lambda d: d.update(format_version=99), "upgrade ckptmgr"),
    (lambda d: d.update(step=6), "directory 5"),
    (lambda d: d.update(step=True), "step"),
    (lambda d: d["files"][1].update(path="../../etc/passwd"), "escapes"),
    (lambda d: d["files"][1].update(path="/abs"), "escapes"),
    (lambda d: d.update(metadata_file="../m.json"), "escapes"),
    (lambda d: d["files"][1].update(size=-1), "size"),
    (lambda d: d["files"][1].update(checksum="md5:00"), "checksum"),
    (lambda d: d.update(total_bytes=1), "total_bytes"),
    (lambda d: d.pop("files"), "files"),
    (lambda d: d.update(time="yesterday"), "ISO"),
    (lambda d: d.update(metrics={"loss": "x"}), "metrics"),
])
def test_manifest_rejects(mutate: object, match: str) -> None:
    d = _doc()
    mutate(d)  # type: ignore[operator]
    with pytest.raises(ManifestError, match=match):
        decode_manifest(json.dumps(d).encode(), expected_step=5)


def test_manifest_rejects_oversized_and_deep_without_parsing() -> None:
    with pytest.raises(ManifestError, match="limit"):
        decode_manifest(b" " * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(ManifestError, match="nested"):
        decode_manifest(b'{"a":' + b"[" * 10_000 + b"]" * 10_000 + b"}")
