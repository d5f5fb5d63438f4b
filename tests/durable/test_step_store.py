"""ckptmgr/step_store.py on real files: commit, listing, the fenced removal door, leftovers and
read verification."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

import ckptmgr
from ckptmgr.step_store import StepStore


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((64,), float(v)), "extra": {"v": v}}


def test_fenced_writer_after_commit_removes_nothing_of_the_new_holder(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Between writer A's commit and its clean-up, writer B takes the root over and starts a
    save: A's clean-up (leftovers, retention) must not delete B's in-flight step."""
    root = f"memory://trust-{os.getpid()}-{time.monotonic_ns()}"
    a = ckptmgr.CheckpointManager(root, save_interval=1, max_to_keep=1)
    assert a.save(1, _state(1))
    holder: dict[str, Any] = {}
    real_scan = StepStore.scan

    def scan_after_takeover(self: StepStore) -> Any:
        if self is a._store and "b" not in holder:  # A's clean-up after committing step 2
            b = ckptmgr.CheckpointManager(root, save_interval=1, take_over=True)
            plan = b._store.begin_save(3, forced=True, overwrite=False, world_size=1)
            assert plan is not None
            b._store.storage.write_bytes(f"{plan.write_dir}/data-{plan.attempt}-r00000-000.bin",
                                         b"in flight")
            holder.update(b=b, plan=plan)
        return real_scan(self)

    monkeypatch.setattr(StepStore, "scan", scan_after_takeover)
    a.save(2, _state(2))  # commits (the lease was A's), then finds itself fenced
    monkeypatch.setattr(StepStore, "scan", real_scan)
    b, plan = holder["b"], holder["plan"]
    files = b._store.storage.list_files(plan.write_dir)
    assert files == {f"data-{plan.attempt}-r00000-000.bin": 9}, "A deleted B's in-flight step"
    with pytest.raises(ckptmgr.errors.LeaseError):
        a.save(4, _state(4))
    b.close()
    a.close()
