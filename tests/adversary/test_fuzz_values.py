"""Fuzzing Python values in a state (tagged JSON, ``ckptmgr/codec/values.py``).

Two ways: generated values round-trip exactly through the encoder and decoder (and the bytes say
what an independent strict reading of the format says); and the stored bytes of a value in a real
step are replaced by mutated ones (the metadata's location and checksum and the manifest fixed to
match, as an attacker would), then restored. Property (tests/_fuzz.py): the value restored is what
the bytes say, read strictly, or a CkptmgrError is raised; bytes that are not a tagged JSON value
never restore.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from _fuzz import (  # noqa: F401 - sandbox_fixture and templates_fixture are fixtures
    Sandbox,
    check,
    fuzz_settings,
    json_file_mutations,
    sandbox_fixture,
    split_v2,
    templates_fixture,
)
from hypothesis import given
from hypothesis import strategies as st

_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=20))
_KEYS = st.one_of(st.text(max_size=8), st.integers(), st.sampled_from(
    ("__tuple__", "__float__", "__bytes__", "__dict__", "__odict__")), st.booleans(), st.none(),
    st.tuples(st.integers(), st.text(max_size=3)))
VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(_KEYS, inner, max_size=4),
        st.dictionaries(st.text(max_size=6), inner, max_size=4).map(OrderedDict)),
    max_leaves=20)


@fuzz_settings(25)
@given(values=st.lists(VALUES, min_size=1, max_size=10))
def test_generated_values_round_trip(fuzz_sandbox: Sandbox, values: list[Any]) -> None:
    """Ten values per case (one child each would cost more than the values)."""
    out = fuzz_sandbox.run("value_roundtrip", value=values)
    check(out, "value-roundtrip", ops=[f"value {values!r}"[:2000]])


# The stored forms worth mutating: each tag, nested, plus the template's own values.
_VALID = [json.dumps(v, separators=(",", ":")).encode() for v in (
    {"__tuple__": [1, 2.5, None]},
    {"__float__": "nan"},
    {"__bytes__": "AP8="},
    {"__dict__": [[3, "three"], [{"__tuple__": [1, "a"]}, [1]]]},
    {"__odict__": [["b", 1], ["a", {"__float__": "-inf"}]]},
    [1, [2, {}], {"k": {"__tuple__": []}}],
    "run-\u03b1",
    7,
)]
# Which of the template's values the bytes replace (keys of its metadata).
_KEYS_IN_TEMPLATE = ("extra.t", "extra.epoch", "extra.l", "extra.blob", "extra.d.3")


@fuzz_settings(50)
@given(data=st.data())
def test_mutated_value_bytes(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                             data: st.DataObject) -> None:
    t = fuzz_templates
    key = data.draw(st.sampled_from(_KEYS_IN_TEMPLATE), label="key")
    m = data.draw(json_file_mutations(_VALID), label="mutation")
    out = fuzz_sandbox.run("value_bytes", root=t["root_v2"], step=1,
                           metadata_name=t["metadata_name"], key=key, value_bytes=m.data)
    check(out, "value-bytes", data=m.data, ops=[f"bytes of {key}", *m.ops])


def test_value_byte_cases(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any]) -> None:
    """Explicit lookalikes: payloads of the wrong shape, which a lenient decoder turns into a
    different value instead of refusing (a 2-character string unpacked as a key and a value, a
    dict's keys taken as a tuple), and deep nesting."""
    t = fuzz_templates
    cases = [b'{"__dict__":["ab"]}', b'{"__tuple__":{"a":1}}', b'{"__tuple__":"xyz"}',
             b'{"__odict__":[["k","v","w"]]}', b'{"__bytes__":"@@@"}', b'{"__float__":1.0}',
             b'{"__dict__":[[[1],2]]}', b"[" * 100_000 + b"]" * 100_000, b"NaN",
             b'{"__bytes__":"' + b"A" * (1 << 22) + b'"}']
    failures = []
    for raw in cases:
        out = fuzz_sandbox.run("value_bytes", root=t["root_v2"], step=1,
                               metadata_name=t["metadata_name"], key="extra.t", value_bytes=raw)
        try:
            check(out, "value-bytes", data=raw, ops=[f"bytes of extra.t = {raw[:60]!r}"])
        except AssertionError as e:
            failures.append(str(e))
    assert not failures, "\n\n".join(failures)
