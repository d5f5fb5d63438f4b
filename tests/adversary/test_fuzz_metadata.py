"""Fuzzing DCP metadata, formats 1 and 2 (``ckptmgr/codec/metadata_json.py`` and
``metadata_columnar.py``, decoded for DCP by ``ckptmgr/dcp/metadata.py``).

The metadata is the map a restore follows: which chunks a tensor has, where their bytes are.
Every case writes the mutated metadata into a copy of a real step and fixes the manifest's size
and checksum of it (whoever can write the metadata can write the manifest), so the bytes reach the
metadata parser and the restore; the data files stay as saved. Property (tests/_fuzz.py): the
restore gives back exactly what was saved, or raises a CkptmgrError, within the bounds; a tensor
left partly untouched (still holding the sentinel it was filled with) is the silent partial
restore of Trust I defect 3.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from _fuzz import (  # noqa: F401 - sandbox_fixture and templates_fixture are fixtures
    EXTREME_INT64,
    Sandbox,
    byte_mutations,
    check,
    framed_mutations,
    fuzz_settings,
    join_v2,
    json_file_mutations,
    sandbox_fixture,
    split_v2,
    templates_fixture,
)
from hypothesis import example, given
from hypothesis import strategies as st


def _restore_with(sandbox: Sandbox, t: dict[str, Any], root_key: str, meta: bytes,
                  what: str, ops: Any) -> None:
    out = sandbox.run("restore", root=t[root_key], step=1, edits={t["metadata_name"]: meta})
    check(out, what, data=meta, ops=ops)


@fuzz_settings(50)
@given(data=st.data())
def test_mutated_format2(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                         data: st.DataObject) -> None:
    t = fuzz_templates
    m = data.draw(framed_mutations([t["metadata_v2"]], split_v2, join_v2, body_int64=True),
                  label="mutation")
    _restore_with(fuzz_sandbox, t, "root_v2", m.data, "metadata-v2", m.ops)


@fuzz_settings(30)
@given(data=st.data())
def test_mutated_format1(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                         data: st.DataObject) -> None:
    t = fuzz_templates
    m = data.draw(json_file_mutations([t["metadata_v1"]]), label="mutation")
    _restore_with(fuzz_sandbox, t, "root_v1", m.data, "metadata-v1", m.ops)


@fuzz_settings(10)
@given(data=st.data())
def test_spliced_formats(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                         data: st.DataObject) -> None:
    """Splices of a format-2 and a format-1 file (and of metadata with a manifest)."""
    t = fuzz_templates
    m = data.draw(byte_mutations([t["metadata_v2"], t["metadata_v1"], t["manifest"]]),
                  label="mutation")
    _restore_with(fuzz_sandbox, t, "root_v2", m.data, "metadata-splice", m.ops)


# ------------------------------------------------------------------ chunk lists by structure

_EXTREME = st.sampled_from((2**62, 2**63 - 1, -1, -(2**63), 2**61, 2**32))


def _chunk(extent: int) -> st.SearchStrategy[tuple[int, int]]:
    small = st.integers(0, extent)
    return st.tuples(st.one_of(small, small, small, _EXTREME), st.one_of(small, small, _EXTREME))


# The explicit cases of Trust I defect 3 (and their format-1 twin).
_DEFECT3 = [
    ("model.b", [((0,), (4,)), ((0,), (4,))], 2),  # a duplicated chunk: the volume adds up
    ("model.b", [((0,), (8,)), ((2**62,), (2**62,))], 2),  # 2**62 + 2**62 wraps in int64
    ("model.b", [((4,), (4,)), ((2**63 - 1,), (2**63 - 1,))], 2),
    ("model.w", [((0, 0), (2, 6)), ((0, 0), (2, 6))], 2),
    ("model.b", [((0,), (4,)), ((0,), (4,))], 1),
]


@pytest.mark.parametrize(("fqn", "chunks", "fmt"), _DEFECT3)
def test_crafted_chunk_list_cases(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                                  fqn: str, chunks: list[Any], fmt: int) -> None:
    t = fuzz_templates
    out = fuzz_sandbox.run("crafted_chunks", root=t["root_v2"], step=1,
                           metadata_name=t["metadata_name"], fqn=fqn, chunks=chunks, fmt=fmt,
                           column="q")
    check(out, f"chunks-v{fmt}", ops=[f"{fqn} chunks = {chunks}"])


@fuzz_settings(50)
@given(data=st.data())
def test_crafted_chunk_lists(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                             data: st.DataObject) -> None:
    """Structured generation: the chunk list of one tensor replaced by drawn boxes (duplicates,
    overlaps, gaps, offsets and sizes near 2**62 and 2**63 whose sums overflow int64), each
    pointing at the saved bytes its box would hold, with their true checksums. Only a list that
    covers the tensor exactly may restore, and then bit-exact."""
    t = fuzz_templates
    fqn = data.draw(st.sampled_from(("model.b", "model.w")), label="tensor")
    rows, cols = (8, None) if fqn == "model.b" else (4, 6)
    n = data.draw(st.integers(1, 4), label="chunks")
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for _ in range(n):
        (off, size) = data.draw(_chunk(rows))
        if cols is None:
            chunks.append(((off,), (size,)))
        else:
            c_off, c_size = data.draw(st.sampled_from(((0, cols), (0, cols), (2**62, 2**62),
                                                       (0, 0), (3, 3))))
            chunks.append(((off, c_off), (size, c_size)))
    fmt = data.draw(st.sampled_from((2, 2, 1)), label="format")
    column = data.draw(st.sampled_from(("q", "r")), label="column")
    out = fuzz_sandbox.run("crafted_chunks", root=t["root_v2"], step=1,
                           metadata_name=t["metadata_name"], fqn=fqn, chunks=chunks, fmt=fmt,
                           column=column)
    check(out, f"chunks-v{fmt}", ops=[f"{fqn} chunks = {chunks} ({column} column)"])


# ---------------------------------------------------------------- huge counts, small files


def _header_with(t: dict[str, Any], fqn: str, **entry: Any) -> bytes:
    header, body = split_v2(t["metadata_v2"])
    for e in header["tensors"]:
        if e["fqn"] == fqn:
            for k in ("grid", "count", "table", "loc"):
                e.pop(k, None)
            e.update(entry)
    return join_v2(header, body)


_COUNTS = (10**6, 10**9, 10**13, 2**40, 2**62, 2**63 - 1)


@fuzz_settings(30)
@given(fqn=st.sampled_from(("model.b", "model.w")), count=st.sampled_from(_COUNTS),
       shape=st.sampled_from(("table-c", "table-a", "table-r", "grid", "grid-size", "loc-q")))
@example(fqn="model.b", count=10**13, shape="table-c")  # Trust I defect 6: a 352-byte file
def test_huge_counts(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any], fqn: str, count: int,
                     shape: str) -> None:
    """A few hundred bytes claiming billions of chunks (a constant or arithmetic column needs no
    bytes per value): the restore must refuse before it allocates or loops over them."""
    t = fuzz_templates
    size = [8] if fqn == "model.b" else [4, 6]
    loc = {"file": {"c": 0}, "pos": {"c": 0}, "sum": {"c": 0}}
    if shape == "table-c":
        meta = _header_with(t, fqn, count=count, table={"c": 0}, loc=loc)
    elif shape == "table-a":
        meta = _header_with(t, fqn, count=count, table={"a": [0, 1]}, loc=loc)
    elif shape == "table-r":
        meta = _header_with(t, fqn, count=count, table={"r": [[0, 1], [1, 2 * len(size) * count]]},
                            loc=loc)
    elif shape == "grid":
        meta = _header_with(t, fqn, size=size, grid=[0, 1, count], loc=loc)
    elif shape == "grid-size":  # a huge tensor split in huge numbers of chunks
        meta = _header_with(t, fqn, size=[count, *size[1:]], grid=[0, 1, count], loc=loc)
    else:
        meta = _header_with(t, fqn, count=count, table={"q": 0}, loc=loc)
    out = fuzz_sandbox.run("restore", root=t["root_v2"], step=1,
                           edits={t["metadata_name"]: meta})
    check(out, "metadata-count", data=meta, ops=[f"{fqn}: {shape}, count {count}"])


@pytest.mark.parametrize("field", ["pos", "length"])
@pytest.mark.parametrize("value", [2**62, 2**63 - 1, 2**64, -1, 10**18])
def test_value_location_extremes(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                                 field: str, value: int) -> None:
    """A Python value's position or length set to an extreme: refused before a read of that size
    is attempted."""
    t = fuzz_templates
    header, body = split_v2(t["metadata_v2"])
    i = {"pos": 2, "length": 3}[field]
    header["values"][0][i] = value
    meta = join_v2(header, body)
    out = fuzz_sandbox.run("restore", root=t["root_v2"], step=1,
                           edits={t["metadata_name"]: meta})
    check(out, "metadata-value-loc", data=meta, ops=[f"values[0].{field} = {value}"])


@fuzz_settings(20)
@given(slot=st.sampled_from(("pos", "sum", "file")), value=st.sampled_from(EXTREME_INT64),
       fqn=st.sampled_from(("model.b", "model.h")))
def test_tensor_location_extremes(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                                  slot: str, value: int, fqn: str) -> None:
    """A tensor chunk's file index, position or checksum column set to an extreme constant."""
    t = fuzz_templates
    header, body = split_v2(t["metadata_v2"])
    entry = next(e for e in header["tensors"] if e["fqn"] == fqn)
    entry["loc"][slot] = {"c": value}
    meta = join_v2(header, body)
    out = fuzz_sandbox.run("restore", root=t["root_v2"], step=1,
                           edits={t["metadata_name"]: meta})
    check(out, "metadata-tensor-loc", data=meta, ops=[f"{fqn}.loc.{slot} = {value}"])


def test_header_length_extremes(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any]) -> None:
    """The format-2 header length (u64) set past the end, to 2**63 and 2**64 - 1."""
    t = fuzz_templates
    meta = t["metadata_v2"]
    for n in (len(meta), len(meta) - 15, 2**63, 2**64 - 1, 0):
        bad = meta[:8] + n.to_bytes(8, "little") + meta[16:]
        out = fuzz_sandbox.run("restore", root=t["root_v2"], step=1,
                               edits={t["metadata_name"]: bad})
        check(out, "metadata-hlen", data=bad, ops=[f"header length = {n}"])


def test_deep_planner_data(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any]) -> None:
    """Deep nesting where the format allows nested tagged JSON (planner_data), both formats."""
    t = fuzz_templates
    deep = "[" * 100_000 + "]" * 100_000
    header, body = split_v2(t["metadata_v2"])
    head = json.dumps(header)[:-1] + ', "planner_data": ' + deep + "}"
    meta2 = join_v2(None, body, header_bytes=head.encode())
    meta1 = t["metadata_v1"][:-1] + b', "planner_data": ' + deep.encode() + b"}"
    for root, meta in (("root_v2", meta2), ("root_v1", meta1)):
        out = fuzz_sandbox.run("restore", root=t[root], step=1, edits={t["metadata_name"]: meta})
        check(out, "metadata-deep", ops=[f"{root}: planner_data nested 100000 deep"])
