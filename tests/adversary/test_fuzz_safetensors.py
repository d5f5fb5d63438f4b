"""Fuzzing what ``load_initial`` reads from a user's directory: safetensors files (header and
offsets) and Hugging Face index files (``model.safetensors.index.json``).

Valid files come from the safetensors package itself. Each case loads a mutated file or directory
with ``CheckpointManager.load_initial`` into a state filled with a sentinel. Property
(tests/_fuzz.py): every tensor of the state either keeps the sentinel (the source has no tensor of
that name) or holds exactly what a strict, independent reading of the bytes gives for it (cast to
the state's dtype); a tensor whose entry is not valid (offsets outside the data, a length that
does not match the shape) must make the load fail; otherwise a CkptmgrError, within the bounds.
Names in an index must be regular files inside the directory: a FIFO must not block, ``..`` and
``.`` must be refused with our error.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
from _fuzz import (  # noqa: F401 - sandbox_fixture and templates_fixture are fixtures
    EXTREME_INTS,
    Sandbox,
    check,
    dump_json,
    framed_mutations,
    fuzz_settings,
    join_safetensors,
    json_file_mutations,
    sandbox_fixture,
    split_safetensors,
    templates_fixture,
)
from hypothesis import given
from hypothesis import strategies as st


@fuzz_settings(50)
@given(data=st.data())
def test_mutated_safetensors_file(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                                  data: st.DataObject) -> None:
    t = fuzz_templates
    valid = [t["safetensors"], *t["hf_shards"].values()]
    m = data.draw(framed_mutations(valid, split_safetensors, join_safetensors), label="mutation")
    out = fuzz_sandbox.run("safetensors_file", data=m.data, flat_like=t["flat"])
    check(out, "safetensors", data=m.data, ops=m.ops)


_OFFSETS = st.sampled_from((*EXTREME_INTS, -8, -16, 0, 32, 96, 100))


@fuzz_settings(30)
@given(data=st.data())
def test_generated_safetensors_entries(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                                       data: st.DataObject) -> None:
    """Structured generation: one entry of a real file's header replaced by drawn fields
    (offsets before the data or past its end, shapes whose product overflows, unknown dtypes)."""
    t = fuzz_templates
    header, body = split_safetensors(t["safetensors"])
    name = data.draw(st.sampled_from(("w", "b", "h", "i")), label="tensor")
    entry = dict(header[name])
    how = data.draw(st.sampled_from(("keep", "shift", "shift", "any")), label="offsets")
    if how == "shift":  # the right length, in the wrong place: before, over or past the data
        start, end = entry["data_offsets"]
        delta = data.draw(st.sampled_from((-start - 8, -start - 96, -(2**62), 2**62, len(body),
                                           len(body) - end + 4, -1)), label="shift")
        entry["data_offsets"] = [start + delta, end + delta]
    elif how == "any":
        entry["data_offsets"] = [data.draw(_OFFSETS), data.draw(_OFFSETS)]
    if data.draw(st.booleans(), label="change shape"):
        entry["shape"] = data.draw(st.lists(st.sampled_from((0, 1, 2, 3, -1, 2**31, 2**62,
                                                             2**64)), max_size=4))
    if data.draw(st.booleans(), label="change dtype"):
        entry["dtype"] = data.draw(st.sampled_from(("F32", "I64", "BF16", "U8", "F8_E4M3",
                                                    "C64", "BOOL", "Q4", "", None, 5)))
    header[name] = entry
    raw = join_safetensors(header, body)
    out = fuzz_sandbox.run("safetensors_file", data=raw, flat_like=t["flat"])
    check(out, "safetensors", data=raw, ops=[f"header[{name!r}] = {entry}"])


@pytest.mark.parametrize("case", [
    "negative-offset", "past-end", "header-length-huge", "header-not-object", "entry-not-object",
    "shape-overflow", "header-length-past-end", "empty-file", "dup-offsets"])
def test_safetensors_cases(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                           case: str) -> None:
    """Explicit cases of Trust I defect 5 (offsets not bounded; malformed headers raising raw
    errors)."""
    t = fuzz_templates
    header, body = split_safetensors(t["safetensors"])
    n = struct.unpack("<Q", t["safetensors"][:8])[0]
    w = header["w"]
    start, end = w["data_offsets"]
    if case == "negative-offset":  # the header's last bytes loaded as weights
        header["w"] = {**w, "data_offsets": [start - 96, end - 96]}
        if start - 96 >= 0:
            header["w"]["data_offsets"] = [-96, 0]
        raw = join_safetensors(header, body)
    elif case == "past-end":
        header["w"] = {**w, "data_offsets": [len(body) - 8, len(body) + 88]}
        raw = join_safetensors(header, body)
    elif case == "header-length-huge":
        raw = struct.pack("<Q", 2**63) + t["safetensors"][8:]
    elif case == "header-length-past-end":
        raw = struct.pack("<Q", len(t["safetensors"])) + t["safetensors"][8:]
    elif case == "header-not-object":
        head = b"[1, 2]"
        raw = struct.pack("<Q", len(head)) + head + body
    elif case == "entry-not-object":
        header["w"] = "F32"
        raw = join_safetensors(header, body)
    elif case == "shape-overflow":
        header["w"] = {**w, "shape": [2**32, 2**32, 2**32]}
        raw = join_safetensors(header, body)
    elif case == "empty-file":
        raw = b""
    else:  # two tensors on the same bytes: what the bytes say, for both
        header["b"] = {**header["b"], "data_offsets": header["i"]["data_offsets"]}
        header["b"]["dtype"] = "F32"
        header["b"]["shape"] = [(header["i"]["data_offsets"][1] - header["i"]["data_offsets"][0])
                                // 4]
        raw = join_safetensors(header, body)
    assert n > 0
    out = fuzz_sandbox.run("safetensors_file", data=raw, flat_like=t["flat"])
    check(out, f"safetensors-{case}", data=raw, ops=[case])


# ------------------------------------------------------------------------ Hugging Face index


@fuzz_settings(30)
@given(data=st.data())
def test_mutated_hf_index(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                          data: st.DataObject) -> None:
    t = fuzz_templates
    m = data.draw(json_file_mutations([t["hf_index"]]), label="mutation")
    files = {**t["hf_shards"], "model.safetensors.index.json": m.data}
    out = fuzz_sandbox.run("hf_dir", files=files, flat=t["flat"])
    check(out, "hf-index", data=m.data, ops=m.ops)


# Names an index may hold, and what is really in the directory under them.
_NAMES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
          "fifo.safetensors", "missing.safetensors", "..", ".", "", "/etc/hostname",
          "../model.safetensors", "sub/x.safetensors", "garbage.safetensors", "a\x00b")


@fuzz_settings(25)
@given(weight_map=st.dictionaries(st.sampled_from(("w", "b", "h", "i", "x")),
                                  st.sampled_from(_NAMES), min_size=1, max_size=5))
def test_generated_hf_index(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                            weight_map: dict[str, str]) -> None:
    """Structured generation: indexes naming shards, FIFOs, missing files, the directory itself,
    its parent, absolute paths and garbage files. A FIFO must not block the load (the time bound
    catches it: Trust I defect 13)."""
    t = fuzz_templates
    index = dump_json({"metadata": {}, "weight_map": weight_map})
    files = {**t["hf_shards"], "model.safetensors.index.json": index,
             "fifo.safetensors": "fifo", "garbage.safetensors": b"\x07" * 40}
    out = fuzz_sandbox.run("hf_dir", files=files, flat=t["flat"], timeout=20)
    check(out, "hf-index", data=index, ops=[f"weight_map = {weight_map}"])


@pytest.mark.parametrize("name", ["fifo.safetensors", "..", "."])
def test_hf_index_special_names(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                                name: str) -> None:
    """Trust I defect 13: an index naming a FIFO blocks load_initial; ``..`` or ``.`` gives
    IsADirectoryError."""
    t = fuzz_templates
    index = json.dumps({"weight_map": {"w": name,
                                       "b": "model-00001-of-00002.safetensors"}}).encode()
    files = {**t["hf_shards"], "model.safetensors.index.json": index, "fifo.safetensors": "fifo"}
    out = fuzz_sandbox.run("hf_dir", files=files, flat=t["flat"], timeout=20)
    check(out, "hf-special", data=index, ops=[f"weight_map names {name!r}"])


def test_hf_index_not_json(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any]) -> None:
    """An index that is not JSON, not an object, or whose weight_map is not a mapping."""
    t = fuzz_templates
    for index in (b"{", b"[]", b'{"weight_map": [1]}', b'{"weight_map": {"w": 5}}', b"\xff\xfe",
                  b'{"weight_map": null}', b"[" * 100_000):
        files = {**t["hf_shards"], "model.safetensors.index.json": index}
        out = fuzz_sandbox.run("hf_dir", files=files, flat=t["flat"])
        check(out, "hf-index", data=index, ops=[f"index = {index[:40]!r}"])
