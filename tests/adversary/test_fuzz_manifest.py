"""Fuzzing the manifest (``<step>/commit.json``), read by every restore, step_info and listing.

Cases start from manifests that real saves wrote and are put back into a copy of the real step,
which a read-only manager then lists, describes (``step_info``) and restores. The property
(tests/_fuzz.py): the restore gives back exactly what was saved (the data files are untouched,
whatever the manifest now claims) or a CkptmgrError is raised, within the memory and time bounds.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from _fuzz import (  # noqa: F401 - sandbox_fixture and templates_fixture are fixtures
    EXTREME_INTS,
    Sandbox,
    _Raw,
    check,
    dump_json,
    fuzz_settings,
    json_file_mutations,
    sandbox_fixture,
    templates_fixture,
)
from hypothesis import given
from hypothesis import strategies as st


@fuzz_settings(50)
@given(data=st.data())
def test_mutated_manifest(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                          data: st.DataObject) -> None:
    t = fuzz_templates
    m = data.draw(json_file_mutations([t["manifest"], t["manifest_other"]]), label="mutation")
    out = fuzz_sandbox.run("restore", root=t["root_v2"], step=1, edits={"commit.json": m.data})
    check(out, "manifest", data=m.data, ops=m.ops)


@fuzz_settings(40)
@given(data=st.data())
def test_mutated_reuse_manifest(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                                data: st.DataObject) -> None:
    """A manifest that lists shared chunks (format_version 2, ``reuse_unchanged=True``)."""
    t = fuzz_templates
    m = data.draw(json_file_mutations([t["manifest_reuse"], t["manifest"]]), label="mutation")
    out = fuzz_sandbox.run("restore", root=t["root_reuse"], step=1, edits={"commit.json": m.data})
    check(out, "manifest", data=m.data, ops=m.ops)


# Fields of a manifest and the values an attacker would put there.
_FIELDS = ("step", "format_version", "world_size", "time", "attempt", "metadata_file", "files",
           "bytes_per_rank", "total_bytes", "metrics", "metadata", "versions", "mesh",
           "byteorder", "format", "shared", "shared_bytes")
_VALUES = st.one_of(
    st.sampled_from(EXTREME_INTS), st.sampled_from((float("nan"), 1e308, -0.0, True, None)),
    st.sampled_from(("", "..", "commit.json", "../1/commit.json", "/etc/passwd", "big",
                     "9999-99-99T99:99:99Z", "2026-01-01T00:00:00Z")),
    st.lists(st.sampled_from(EXTREME_INTS), max_size=3),
    st.dictionaries(st.sampled_from(("0", "-1", "x", "99999999999999999999")),
                    st.sampled_from(EXTREME_INTS), max_size=3))
_CHUNK = "chunks/" + "0123456789abcdef" * 2
_FILE_ENTRY = st.fixed_dictionaries({
    "path": st.sampled_from(("data.bin", "..", ".", "a/b", "commit.json", "\u202e", "x" * 300,
                             _CHUNK, _CHUNK.upper(), f"{_CHUNK}0", f"../{_CHUNK}",
                             f"chunks/../{_CHUNK[7:]}", f"/{_CHUNK}", f"x/{_CHUNK}",
                             "chunks/" + "0" * 32 + ".tmp-0123456789ab")),
    "size": st.sampled_from(EXTREME_INTS),
    "checksum": st.sampled_from(("xxh3_64:0000000000000000", "xxh3_64:", "md5:0", "")),
})


@fuzz_settings(30)
@given(data=st.data())
def test_generated_manifest_fields(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                                   data: st.DataObject) -> None:
    """Structured generation: the real manifest with chosen fields set to extreme values, and
    file lists of extreme entries (huge sizes, paths out of the step, repeated entries)."""
    t = fuzz_templates
    root = data.draw(st.sampled_from(("root_v2", "root_reuse")), label="root")
    doc = json.loads(t["manifest" if root == "root_v2" else "manifest_reuse"])
    changes = data.draw(st.dictionaries(st.sampled_from(_FIELDS), _VALUES, min_size=1,
                                        max_size=3), label="fields")
    doc.update(changes)
    if data.draw(st.booleans(), label="extra file entries"):
        entries = data.draw(st.lists(_FILE_ENTRY, min_size=1, max_size=3), label="entries")
        times = data.draw(st.sampled_from((1, 2, 100_000)), label="repeated")
        key = data.draw(st.sampled_from(("files", "shared")), label="into")
        files = doc.get(key) if isinstance(doc.get(key), list) else []
        doc[key] = files + entries * times
    raw = dump_json(doc)
    out = fuzz_sandbox.run("restore", root=t[root], step=1, edits={"commit.json": raw})
    check(out, "manifest", data=raw, ops=[f"set {k} = {v!r}"[:200] for k, v in changes.items()])


_CASES = {
    "metric-overflows-float": ("metrics", {"loss": 10**400}),
    "step-5000-digits": ("step", _Raw("9" * 5000)),
    "world-size-2**70": ("world_size", 2**70),
    "rank-key-huge": ("bytes_per_rank", {"9" * 30: 1}),
    "rank-key-fullwidth-digit": ("bytes_per_rank", {"\uff10": 1}),
    "step-2**63": ("step", 2**63),
    "size-2**64": ("files", "size"),
    "mesh-deep": ("mesh", _Raw("[" * 100_000 + "]" * 100_000)),
    "time-year-10000": ("time", "10000-01-01T00:00:00Z"),
    "time-offset-max": ("time", "9999-12-31T23:59:59.999999-23:59"),
}


# Shared chunks (format_version 2): the one path form outside the step directory, exactly.
_SHARED_CASES: dict[str, Any] = {
    "shared-in-version-1": lambda d: d.update(format_version=1),
    "shared-dotdot": lambda d: d["shared"][0].update(path="../" + d["shared"][0]["path"]),
    "shared-uppercase": lambda d: d["shared"][0].update(path=d["shared"][0]["path"].upper()),
    "shared-subdirectory": lambda d: d["shared"][0].update(
        path=d["shared"][0]["path"].replace("chunks/", "chunks/x/")),
    "shared-absolute": lambda d: d["shared"][0].update(path="/" + d["shared"][0]["path"]),
    "shared-is-a-step-file": lambda d: d["shared"][0].update(path=d["metadata_file"]),
    "shared-temporary": lambda d: d["shared"][0].update(path=d["shared"][0]["path"]
                                                        + ".tmp-0123456789ab"),
    "shared-twice": lambda d: d["shared"].append(dict(d["shared"][0])),
    "shared-swapped": lambda d: d["shared"][0].update(path=d["shared"][-1]["path"]),
    "shared-size-off": lambda d: d["shared"][0].update(size=d["shared"][0]["size"] + 1),
    "shared-checksum-off": lambda d: d["shared"][0].update(checksum="xxh3_64:" + "0" * 16),
    "shared-dropped": lambda d: d["shared"].pop(),
    "shared-bytes-off": lambda d: d.update(shared_bytes=d["shared_bytes"] + 1),
    "shared-not-a-list": lambda d: d.update(shared={"chunks": 1}),
    "shared-missing": lambda d: d.pop("shared"),
}


@pytest.mark.parametrize("case", list(_SHARED_CASES))
def test_reuse_manifest_cases(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                              case: str) -> None:
    """A shared chunk path that leaves the form ``chunks/<32 hex>``, or lists that disagree with
    the metadata: refused (UnsafeCheckpointError, CorruptCheckpointError), never read."""
    doc = json.loads(fuzz_templates["manifest_reuse"])
    assert doc["format_version"] == 2 and len(doc["shared"]) >= 2
    _SHARED_CASES[case](doc)
    raw = dump_json(doc)
    out = fuzz_sandbox.run("restore", root=fuzz_templates["root_reuse"], step=1,
                           edits={"commit.json": raw})
    check(out, "manifest", data=raw, ops=[case])
    # A restore checks every item against the metadata's checksum, and a file's checksum in
    # the manifest is for whole-file checks (verify): these two may restore, bit-exact.
    if case not in ("shared-swapped", "shared-checksum-off"):
        assert out.kind == "raised", (case, out.describe())


@pytest.mark.parametrize("case", list(_CASES))
def test_manifest_cases(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any], case: str) -> None:
    """Numbers Python parses but cannot convert (a float from a 400-digit int, an int of 5000
    digits), numbers beyond every bound, keys that look like digits."""
    doc = json.loads(fuzz_templates["manifest"])
    field, value = _CASES[case]
    if value == "size":
        doc["files"][0]["size"] = 2**64
    else:
        doc[field] = value
    raw = dump_json(doc)
    out = fuzz_sandbox.run("restore", root=fuzz_templates["root_v2"], step=1,
                           edits={"commit.json": raw})
    check(out, "manifest", data=raw, ops=[case])
