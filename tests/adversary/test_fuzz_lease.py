"""Fuzzing the writer lease file (``<root>/.ckptmgr-lease.json``, ``ckptmgr/lease.py``).

The lease is read by every writer's constructor, which decides from it whether another live writer
holds the root. Cases start from a lease a real manager wrote (this host, this PID namespace) and
open a writer on a root holding the mutated one. Property (tests/_fuzz.py): the constructor
returns (it took the lease: the file then names this process) or raises a CkptmgrError
(LeaseError: a live holder), within the bounds; a FIFO in the lease's place must not block.
Where the holder is known, the answer is too: a holder that cannot be alive (a pid <= 0 or above
the system's maximum, on this host and PID namespace: Trust I defect 7) is taken over; a live
process (this test's own) keeps the lease.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from _fuzz import (  # noqa: F401 - sandbox_fixture and templates_fixture are fixtures
    Sandbox,
    check,
    dump_json,
    fuzz_settings,
    json_file_mutations,
    pid_max,
    sandbox_fixture,
    templates_fixture,
)
from hypothesis import given
from hypothesis import strategies as st

# Unexpired (and a constant, so that hypothesis sees the same input on every run): the year 2100.
_FAR = 4102444800.0


@fuzz_settings(40)
@given(data=st.data())
def test_mutated_lease(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                       data: st.DataObject) -> None:
    t = fuzz_templates
    doc = json.loads(t["lease"])
    # A live holder to start from (pid 1 is alive in every PID namespace), unexpired: the
    # mutated fields decide.
    doc.update(pid=1, expires=_FAR)
    m = data.draw(json_file_mutations([dump_json(doc)]), label="mutation")
    out = fuzz_sandbox.run("lease", lease=m.data, expect=None)
    check(out, "lease", data=m.data, ops=m.ops)


def _impossible_pids() -> list[Any]:
    return [-1, 0, -(2**63), 2**70, 2**63, 2**31, pid_max() + 1, 1e308, float("inf"),
            float("nan"), -0.5]


@pytest.mark.parametrize("pid", _impossible_pids(), ids=repr)
def test_impossible_pid_is_taken_over(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                                      pid: Any) -> None:
    """Trust I defect 7: a pid of 2**70 raised OverflowError; -1 was reported as a live holder."""
    doc = json.loads(fuzz_templates["lease"])
    doc.update(pid=pid, expires=_FAR)
    raw = dump_json(doc)
    out = fuzz_sandbox.run("lease", lease=raw, expect="dead")
    check(out, "lease-pid", data=raw, ops=[f"pid = {pid!r}, expires in 2100"])


def test_live_holder_keeps_the_lease(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                                     ) -> None:
    """The other side of the oracle: this test process is alive, so its lease is kept."""
    doc = json.loads(fuzz_templates["lease"])
    doc.update(pid=os.getpid(), expires=_FAR)
    raw = dump_json(doc)
    out = fuzz_sandbox.run("lease", lease=raw, expect="live")
    check(out, "lease-live", data=raw, ops=[f"pid = {os.getpid()} (alive)"],
          allow=lambda o: o.exc_type.endswith("LeaseError"))


_FIELD_VALUES: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from((-1, 0, 2**70, 2**63, 1e308, float("nan"), float("-inf"), True, None, "",
                     "12", [], {}, "x" * 70_000)),
    st.integers(), st.floats(), st.text(max_size=10))


@fuzz_settings(30)
@given(fields=st.dictionaries(st.sampled_from(("id", "host", "pid", "job", "since", "expires",
                                               "pid_ns")), _FIELD_VALUES, min_size=1,
                              max_size=3))
def test_generated_lease_fields(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                                fields: dict[str, Any]) -> None:
    """Structured generation: fields of a real lease set to extremes and wrong types."""
    doc = json.loads(fuzz_templates["lease"])
    doc["expires"] = _FAR
    doc.update(fields)
    raw = dump_json(doc)
    out = fuzz_sandbox.run("lease", lease=raw, expect=None)
    check(out, "lease", data=raw, ops=[f"{k} = {v!r}"[:100] for k, v in fields.items()])


@pytest.mark.parametrize("content", ["fifo", b"", b"\xff" * 10, b"[" * 100_000,
                                     b" " * (1 << 20)], ids=["fifo", "empty", "binary", "deep",
                                                              "1MiB"])
def test_lease_file_cases(fuzz_sandbox: Sandbox, content: Any) -> None:
    """Trust I defect 13: a FIFO at the lease's path blocked the constructor for good."""
    out = fuzz_sandbox.run("lease", lease=content, expect=None, timeout=20)
    check(out, "lease-file", ops=[f"lease file = {content[:20]!r}"])
