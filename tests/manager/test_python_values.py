"""Every Python container shape in a state round-trips exactly through save and restore (empty dicts
inside list values were dropped by DCP's flattening of sharded tensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptmgr import (
    CheckpointManager,
)


def _same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (1 is not 1.0, a tuple is not a list)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return bool(a == b)


def _blank(value: Any) -> Any:
    """A restore target of the same structure as ``value`` (what the state flattens the same
    way: dicts are walked, lists and tuples only when they hold a tensor), leaves wiped."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_blank(v) for v in value)
    return None


def test_empty_dict_inside_a_list_value_round_trips(tmp_path: Path) -> None:
    # Lightning's checkpoint of a plain-SGD optimizer: its state is an empty dict.
    opt = [{"state": {}, "param_groups": [{"lr": 0.1, "momentum": 0, "params": [0, 1]}]}]
    state = {"w": torch.ones(2), "optimizer_states": opt,
             "deep": [{0: {"a": {}}, "x": [{}], "y": ({},), "z": ()}],
             "mixed": [torch.ones(1), {}, [], (), [{}]]}
    with CheckpointManager(str(tmp_path / "run"), save_interval=1) as mgr:
        mgr.save(1, state)
        out = _blank(state)
        mgr.restore(1, out)
    assert _same(out, state), out
    assert out["optimizer_states"][0]["state"] == {}


_KEYS = st.text(alphabet="abcxyz_", min_size=1, max_size=4)


# Empty containers are leaves as likely as scalars: they are what DCP's flattening dropped.
_SCALARS: Any = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
            | st.floats(allow_nan=False) | st.text(max_size=5)
            | st.builds(dict) | st.builds(list) | st.builds(tuple))


def _containers(children: Any) -> Any:
    return (st.lists(children, max_size=3) | st.tuples() | st.tuples(children)
            | st.tuples(children, children) | st.dictionaries(_KEYS, children, max_size=3)
            | st.dictionaries(st.integers(0, 5), children, max_size=2))


_VALUES = st.recursive(_SCALARS, _containers, max_leaves=12)


@pytest.fixture(scope="module")
def shared_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("roundtrip") / "run")


@pytest.mark.parametrize("mode", ["save", "save_async"])
@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_VALUES, nested=_VALUES)
def test_python_values_round_trip_exactly(shared_root: str, mode: str, value: Any,
                                          nested: Any) -> None:
    # Python values at the top, inside a walked dict, and beside a tensor in a walked list.
    state = {"v": value, "d": {"inner": nested, "e": {}}, "t": [torch.arange(3.0), nested]}
    with CheckpointManager(shared_root, save_interval=1, max_to_keep=1,
                           async_mode="thread") as mgr:
        step = (mgr.latest_step() or 0) + 1
        getattr(mgr, mode)(step, state)
        mgr.join()
        out = _blank(state)
        mgr.restore(step, out)
    assert _same(out, state), (out, state)
