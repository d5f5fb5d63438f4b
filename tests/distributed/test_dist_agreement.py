"""Rank agreement on real gloo groups (2 ranks, one spawned group for every case).

- ``all_steps()`` is the coordinator's listing, broadcast: identical on every rank even when
  another rank's own listing is stale (here rank 1's storage would list only old steps; it is
  never asked);
- a restore must name the same step on every rank;
- a failure injected on rank 1 only, while saving or restoring, is raised on every rank, naming
  rank 1, and leaves nothing committed; the manager keeps working afterwards;
- a rank that never joins a save makes the others fail within the collective timeout, not hang.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import open_file_gate, run_ranks, wait_for_file


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": {str(i): torch.randn(32, 32, generator=g) for i in range(4)},
            "progress": {"step": seed}}


@contextlib.contextmanager
def _patched(cls: type, name: str, replacement: Any, active: bool) -> Iterator[None]:
    """Replace ``cls.name`` while inside, on the ranks where ``active``."""
    if not active:
        yield
        return
    original = getattr(cls, name)
    setattr(cls, name, replacement)
    try:
        yield
    finally:
        setattr(cls, name, original)


def _error(fn: Any) -> tuple[str, str, Any]:
    """(exception type name, message, failures or None) of ``fn()``, which must raise."""
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e), sorted(getattr(e, "failures", {}) or {})
    raise AssertionError("no exception")


def _cases(rank: int, world: int, root: str) -> dict[str, Any]:
    import ckptmgr
    from ckptmgr.storage.local import LocalStorage

    out: dict[str, Any] = {}
    # Every manager stays open to the end: see _dist.make_group (a closed manager's group name is
    # reused by the next one on the same ranks).
    with contextlib.ExitStack() as managers:
        first = managers.enter_context(ckptmgr.CheckpointManager(root, save_interval=1))
        first.save(1, _state(1))
        first.save(2, _state(2))

        # -- stale listing on rank 1: it would see only step 1, and is never asked
        calls: list[int] = []

        def stale_scan(self: Any, marker: str) -> Any:
            calls.append(1)
            return [e for e in original_scan(self, marker) if e.name in ("1",)]

        original_scan = LocalStorage.scan_root
        with _patched(LocalStorage, "scan_root", stale_scan, rank == 1):
            mgr = managers.enter_context(
                ckptmgr.CheckpointManager(root, save_interval=1, take_over=True))
            out["steps_at_start"] = mgr.all_steps()
            mgr.save(3, _state(3))
            out["steps_after_save"] = mgr.all_steps()
            out["latest"] = mgr.latest_step()
        out["stale_listing_calls"] = len(calls)

        # -- every rank must restore the same step
        out["disagree"] = _error(lambda: mgr.restore(2 + rank, _state(0)))
        target = _state(0)
        mgr.restore(3, target)
        out["restored_step"] = target["progress"]["step"]
        out["restored_equal"] = all(torch.equal(target["w"][k], _state(3)["w"][k])
                                    for k in target["w"])

        # -- a write failure on rank 1 only
        def failing_writer(self: Any, path: str, size_hint: int | None = None) -> Any:
            raise OSError(f"injected write failure for {path}")

        with _patched(LocalStorage, "open_writer", failing_writer, rank == 1):
            t = time.perf_counter()
            out["save_failure"] = _error(lambda: mgr.save(4, _state(4)))
            out["save_failure_s"] = time.perf_counter() - t
        out["steps_after_failed_save"] = mgr.all_steps()
        out["root_after_failed_save"] = sorted(n for n in os.listdir(root)
                                               if not n.startswith(".ckptmgr-lease"))
        mgr.save(4, _state(4))  # the manager still works

        # -- a read failure on rank 1 only
        def failing_read(self: Any, path: str, offset: int, buf: memoryview) -> None:
            raise OSError(f"injected read failure for {path}")

        with _patched(LocalStorage, "read_into", failing_read, rank == 1):
            t = time.perf_counter()
            out["restore_failure"] = _error(lambda: mgr.restore(4, _state(0)))
            out["restore_failure_s"] = time.perf_counter() - t
        target = _state(0)
        mgr.restore(4, target)
        out["restored_after_failure"] = target["progress"]["step"]

        # -- a user object failing on rank 1 only while the state is captured
        class Broken:
            def state_dict(self) -> dict[str, Any]:
                if rank == 1:
                    raise ValueError("broken state_dict on this rank")
                return {"x": torch.ones(1)}

            def load_state_dict(self, sd: dict[str, Any]) -> None:
                pass

        out["capture_failure"] = _error(lambda: mgr.save(5, {"b": Broken()}))
        out["final_steps"] = mgr.all_steps()

        # -- a rank that never joins: the others fail within the collective timeout
        os.environ["CKPTMGR_COLLECTIVE_TIMEOUT_S"] = "3"
        short = managers.enter_context(
            ckptmgr.CheckpointManager(root, save_interval=1, take_over=True))
        gate = os.path.join(os.path.dirname(root), "straggler-failed")
        if rank == 0:
            t = time.perf_counter()
            try:
                out["straggler"] = _error(lambda: short.save(6, _state(6)))
                out["straggler_s"] = time.perf_counter() - t
            finally:
                open_file_gate(gate)
        else:
            wait_for_file(gate)  # stays away from the save until rank 0 has given up on it
    return out


@pytest.mark.slow
def test_rank_agreement_and_failures(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    r0, r1 = run_ranks(_cases, 2, root, timeout_s=240)
    for r in (r0, r1):
        assert r["steps_at_start"] == [1, 2]
        assert r["steps_after_save"] == [1, 2, 3] and r["latest"] == 3
        kind, msg, _ = r["disagree"]
        assert kind == "ConfigError" and "ranks disagree" in msg
        assert r["restored_step"] == 3 and r["restored_equal"]
        kind, msg, failures = r["save_failure"]
        assert kind == "SaveError" and "rank 1" in msg and "injected write failure" in msg
        assert failures == [1] and r["save_failure_s"] < 30
        assert r["steps_after_failed_save"] == [1, 2, 3]
        kind, msg, _ = r["restore_failure"]
        assert kind in ("RestoreError", "StorageError") and "rank 1" in msg
        assert "injected read failure" in msg and r["restore_failure_s"] < 30
        assert r["restored_after_failure"] == 4
        kind, msg, _ = r["capture_failure"]
        assert "broken state_dict" in msg
        assert r["final_steps"] == [1, 2, 3, 4]
    assert r1["stale_listing_calls"] == 0  # only the coordinator lists
    assert "[rank 1]" in r0["capture_failure"][1]
    # nothing of the failed attempt is left: no staging directory, no step 4 before the retry
    assert r0["root_after_failed_save"] == ["1", "2", "3"]
    kind, msg, failures = r0["straggler"]
    assert r0["straggler_s"] < 30, r0["straggler"]
    # the rank that never joined is named, with the phase it was missing from
    assert kind == "SaveError" and "ranks [1] did not arrive" in msg and "'plan'" in msg, msg
    assert failures == [1]
