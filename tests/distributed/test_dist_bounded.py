"""Bounded collectives and listing once, on 3 real gloo ranks (one spawned group for both cases).

- Listing once: on restore only the coordinator lists the step and reads its manifest and
  metadata (counted per rank on the local storage); every rank reads only data. ``all_steps``
  touches no storage at all (the view the coordinator listed).
- A rank SIGKILLed in the middle of a save (held at a gate inside its write, after the others have
  written) makes the others fail with a SaveError naming rank 2 and the phase ``write``, within
  ``collective_timeout_s``, instead of hanging; nothing is committed.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import open_file_gate, start_ranks, wait_for_file

# Storage calls that list or read anything but tensor data.
_META_CALLS = ("scan_root", "list_files", "exists", "size", "is_symlink", "read_bytes")
_DATA_CALLS = ("read_into", "open_reader")


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": {str(i): torch.randn(16, 16, generator=g) for i in range(3)},
            "progress": {"step": seed}}


@contextlib.contextmanager
def _counting(counts: Counter[str]) -> Iterator[None]:
    """Count LocalStorage calls by name in this process while inside."""
    from ckptmgr.storage.local import LocalStorage

    originals = {n: getattr(LocalStorage, n) for n in (*_META_CALLS, *_DATA_CALLS)
                 if hasattr(LocalStorage, n)}

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name, fn in originals.items():
        setattr(LocalStorage, name, counted(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(LocalStorage, name, fn)


def _cases(rank: int, world: int, root: str, gates: str) -> dict[str, Any]:
    import ckptmgr
    from ckptmgr.dcp.writer import CkptStorageWriter

    os.environ.pop("CKPTMGR_COLLECTIVE_TIMEOUT_S", None)  # the keyword alone sets the timeout
    out: dict[str, Any] = {}
    mgr = ckptmgr.CheckpointManager(root, save_interval=1, collective_timeout_s=30.0)
    mgr.save(1, _state(1))

    # -- listing once
    counts: Counter[str] = Counter()
    target = _state(0)
    with _counting(counts):
        mgr.restore(1, target)
    out["restore_calls"] = dict(counts)
    out["restored"] = target["progress"]["step"] == 1 and all(
        torch.equal(target["w"][k], _state(1)["w"][k]) for k in target["w"])
    counts.clear()
    with _counting(counts):
        out["steps"] = mgr.all_steps()
    out["all_steps_calls"] = dict(counts)

    # -- rank 2 is killed while it writes step 2, after ranks 0 and 1 have written theirs
    original = CkptStorageWriter.write_data

    def gated(self: Any, plan: Any, planner: Any) -> Any:
        if rank == 2:
            wait_for_file(os.path.join(gates, "wrote-0"))
            wait_for_file(os.path.join(gates, "wrote-1"))
            open_file_gate(os.path.join(gates, "held"))
            wait_for_file(os.path.join(gates, "never"), timeout_s=300)  # SIGKILLed here
        result = original(self, plan, planner)
        open_file_gate(os.path.join(gates, f"wrote-{rank}"))
        return result

    CkptStorageWriter.write_data = gated  # type: ignore[method-assign]
    try:
        mgr.save(2, _state(2))
        out["killed"] = None
    except Exception as e:
        out["killed"] = (type(e).__name__, str(e), getattr(e, "phase", None),
                         getattr(e, "missing_ranks", None), sorted(getattr(e, "failures", {})))
    finally:
        CkptStorageWriter.write_data = original  # type: ignore[method-assign]
    out["steps_after_kill"] = mgr.all_steps()
    out["root_after_kill"] = sorted(n for n in os.listdir(root) if not n.startswith(".ckptmgr"))
    mgr.close()
    return out


@pytest.mark.slow
def test_listing_once_and_a_sigkilled_rank_mid_save(tmp_path: Path) -> None:
    root, gates = str(tmp_path / "run"), tmp_path / "gates"
    gates.mkdir()
    ranks = start_ranks(_cases, 3, root, str(gates), timeout_s=240)
    try:
        wait_for_file(str(gates / "held"), timeout_s=200)
        os.kill(ranks.procs[2].pid, signal.SIGKILL)  # type: ignore[arg-type]
        results = ranks.results([0, 1])
    finally:
        ranks.close()
    for rank, r in results.items():
        assert r["restored"], rank
        meta = {k: v for k, v in r["restore_calls"].items() if k in _META_CALLS}
        if rank == 0:  # one listing of the step, the manifest and metadata read once
            assert meta.get("list_files") == 1 and "scan_root" not in meta, meta
            assert meta.get("read_bytes") == 2, meta
        else:  # nothing listed or read but its own data
            assert meta == {}, (rank, r["restore_calls"])
        assert sum(r["restore_calls"].get(k, 0) for k in _DATA_CALLS) > 0
        assert r["steps"] == [1] and r["all_steps_calls"] == {}
        assert r["killed"] is not None, f"rank {rank} did not fail"
        kind, msg, phase, missing, failures = r["killed"]
        assert kind == "SaveError", msg
        assert phase == "write" and missing == [2] and failures == [2], msg
        assert "ranks [2] did not arrive" in msg and "'write'" in msg and "step 2" in msg, msg
        assert r["steps_after_kill"] == [1]
    assert results[0]["root_after_kill"] == ["1"]  # the failed attempt was discarded
