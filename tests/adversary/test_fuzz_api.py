"""Fuzzing the public API's inputs: wrong types for ``state_dict`` and ``step``.

``save``, ``save_async``, ``restore`` and ``restore_latest`` are called on a root holding one good
step with a state dict that is not one (a list, None, a tensor, a str, a module, dicts with keys
that are not str at the top or nested, a Mapping that is not a dict, a non-str key beside a tensor)
or a step that is not an integral number (bools, floats, strings, None, a float tensor, numbers out
of range). Property: the call returns, or raises one of our errors (``ckptmgr.errors``, each a
subclass of the builtin a caller would expect), never a raw ``AttributeError``/``TypeError`` from
inside (Trust I defect 9: ``restore(step, [..])`` raised ``AttributeError``); a call that raised
changed nothing in the root (every file byte-identical, the lease's renewal aside); a save that
returned True committed a step that restores bit-exact; a restore that returned gave back the
saved values.

The cases run in the fuzz sandbox (tests/_fuzz.py); the target is :func:`target_api`.
"""

from __future__ import annotations

import collections
import os
import tempfile
from typing import Any

import pytest
from _fuzz import (  # noqa: F401 - sandbox_fixture is a fixture
    OracleError,
    Sandbox,
    check,
    fuzz_settings,
    sandbox_fixture,
)
from hypothesis import given
from hypothesis import strategies as st

CALLS = ("save", "save_async", "restore", "restore_latest")
STATES = ("list", "none", "tensor", "str", "bytes", "int", "module", "tuple", "int-key",
          "nested-int-key", "tuple-key", "none-key", "ordered", "mapping-proxy", "set",
          "nested-list-of-tensors", "good")
STEPS = ("good", "true", "false", "float", "float-int", "nan", "str", "str-int", "none",
         "float-tensor", "bool-tensor", "huge", "negative", "list", "bytes")
LEASE = ".ckptmgr-lease.json"


def _state(kind: str) -> Any:
    """(in the child) The state dict of kind ``kind``; tensors hold the saved step-1 values."""
    import types

    import torch

    w = torch.arange(6, dtype=torch.float32)
    return {
        "list": [w], "none": None, "tensor": w, "str": "w", "bytes": b"w", "int": 7,
        "module": torch.nn.Linear(2, 3), "tuple": (("w", w),), "int-key": {1: w},
        "nested-int-key": {"m": {2: w}}, "tuple-key": {("w",): w}, "none-key": {None: w},
        "ordered": collections.OrderedDict(w=w), "mapping-proxy": types.MappingProxyType({"w": w}),
        "set": {"w"}, "nested-list-of-tensors": {"m": [w, {"k": w}]}, "good": {"w": w},
    }[kind]


def _step(kind: str) -> Any:
    import torch

    return {
        "good": 1, "true": True, "false": False, "float": 1.5, "float-int": 1.0,
        "nan": float("nan"), "str": "one", "str-int": "1", "none": None,
        "float-tensor": torch.tensor(1.0), "bool-tensor": torch.tensor(True), "huge": 2**70,
        "negative": -1, "list": [1], "bytes": b"1",
    }[kind]


def _snapshot(root: str) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for d, _, files in os.walk(root):
        for name in files:
            path = os.path.join(d, name)
            rel = os.path.relpath(path, root)
            if name == LEASE:  # renewed on its own clock: its presence counts, not its bytes
                out[rel] = None
                continue
            with open(path, "rb") as f:
                out[rel] = f.read()
    return out


def _filled(state: Any) -> Any:
    """A restore target shaped like ``state``: its tensors (under dicts) hold a sentinel."""
    import copy

    import torch

    if isinstance(state, torch.Tensor):
        return torch.full_like(state, -5.0)
    if isinstance(state, dict):
        out = copy.copy(state)
        for k, v in state.items():
            out[k] = _filled(v)
        return out
    return copy.deepcopy(state)


def _same(a: Any, b: Any) -> bool:
    """Exact equality through dicts, lists and tuples (tensors: dtype, shape and values)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
            _same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def target_api(call: str, state: str, step: str) -> dict[str, Any]:
    """Call ``call`` with the state dict and step of the given kinds on a root holding step 1
    (``{"w": arange(6)}``). Oracle: see the module docstring."""
    import torch

    import ckptmgr

    root = os.path.join(tempfile.mkdtemp(), "root")
    good = {"w": torch.arange(6, dtype=torch.float32)}
    with ckptmgr.CheckpointManager(root, 1) as mgr:
        if not hasattr(mgr, call):  # restore_latest is newer than some trees tested
            return {"result": f"no {call} here"}
        mgr.save(1, {"w": good["w"].clone()})
        before = _snapshot(root)
        sd, st_ = _state(state), _step(step)
        try:
            if call == "save":
                result: Any = mgr.save(st_ if step != "good" else 2, sd, force=True)
            elif call == "save_async":
                result = mgr.save_async(st_ if step != "good" else 2, sd, force=True)
                mgr.wait_until_finished()
            elif call == "restore":
                result = mgr.restore(st_, sd)
            else:
                result = mgr.restore_latest(sd)
        except BaseException as e:
            after = _snapshot(root)
            if after != before:
                changed = sorted(n for n in set(before) | set(after)
                                 if before.get(n, b"") != after.get(n, b""))
                raise OracleError(f"{call} raised {type(e).__name__}: {e}, and changed the root: "
                                  f"{changed}") from e
            raise
        if call in ("save", "save_async") and result:
            saved = int(st_) if step != "good" else 2
            if saved not in mgr.all_steps():
                raise OracleError(f"{call} returned {result!r}, step {saved} is not listed")
            if isinstance(sd, dict):
                target = _filled(sd)
                mgr.restore(saved, target)
                if not _same(target, sd):
                    raise OracleError(f"{call} of a {state} state: restored {target!r}, saved "
                                      f"{sd!r}")
        if call in ("restore", "restore_latest") and isinstance(sd, dict) and "w" in sd \
                and isinstance(sd["w"], torch.Tensor) and not torch.equal(sd["w"], good["w"]):
            raise OracleError(f"{call} returned, but w is {sd['w']}")
    return {"result": repr(result)[:200]}


_TARGET = "adversary.test_fuzz_api:target_api"


def _run(sandbox: Sandbox, call: str, state: str, step: str) -> None:
    out = sandbox.run(_TARGET, call=call, state=state, step=step)
    check(out, f"api-{call}", ops=[f"{call}(step={step}, state_dict={state})"])


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("state", ["list", "none", "tensor"])
def test_defect9_cases(fuzz_sandbox: Sandbox, call: str, state: str) -> None:
    """Trust I defect 9's inputs, for every call."""
    _run(fuzz_sandbox, call, state, "good")


# One wrong input at a time (a wrong step beside a wrong state would hide the state's check),
# then both.
_INPUTS = st.one_of(st.tuples(st.sampled_from(STATES), st.just("good")),
                    st.tuples(st.just("good"), st.sampled_from(STEPS)),
                    st.tuples(st.sampled_from(STATES), st.sampled_from(STEPS)))


@fuzz_settings(40)
@given(call=st.sampled_from(CALLS), inputs=_INPUTS)
def test_wrong_types(fuzz_sandbox: Sandbox, call: str, inputs: tuple[str, str]) -> None:
    _run(fuzz_sandbox, call, *inputs)
