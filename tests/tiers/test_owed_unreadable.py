"""A local step owed to the durable tier that one rank cannot read for a while (an I/O error,
not a positive finding) is never deleted for it: kept on every rank until uploaded.

Real gloo ranks, real local files; the fault is the smallest one that makes it: this rank's
reads of one local step's files (its manifest excepted) raise EIO, as a flaky disk's would.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import run_ranks

import ckptmgr
from ckptmgr import AsyncSaveError
from ckptmgr.errors import CorruptCheckpointError, StateMismatchError, StorageError


def _state(step: int) -> dict[str, Any]:
    # The same on every rank: the durable copy holds one replicated tensor, restored anywhere.
    return {"w": torch.full((32,), float(step)), "extra": {"step": step}}



def _owe_step_10(mgr: ckptmgr.CheckpointManager) -> None:
    """Save step 10 on the local tier, owed to the durable tier, its upload never run."""
    assert mgr._uploads is not None
    mgr._uploads.close()  # as if the job died before the upload
    mgr.save_async(10, _state(10))

def _target() -> dict[str, Any]:
    return {"w": torch.zeros(32), "extra": {"step": -1}}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["w"], b["w"]) and a["extra"] == b["extra"]


def _unreadable(nodes: str, step: int, times: int | None,
                patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """This process's reads of local ``step``'s files under ``nodes`` (its manifest excepted,
    so that whose step it is can still be told) fail with EIO: the first ``times`` of them, or
    every one (None). ``patch``: how (``monkeypatch.setattr`` in the test's own process)."""
    from ckptmgr.storage import local

    real = local.LocalStorage.read_bytes
    left = [times]

    def read_bytes(self: Any, path: str, start: int = 0, length: int | None = None) -> bytes:
        if (self.root.startswith(nodes) and path.startswith(f"{step}/")
                and not path.endswith("/commit.json") and left[0] != 0):
            if left[0] is not None:
                left[0] -= 1
            raise StorageError(f"read failed for {self.url}/{path} (injected)") from OSError(
                errno.EIO, "Input/output error (injected)", path)
        return real(self, path, start, length)

    patch(local.LocalStorage, "read_bytes", read_bytes)


def _no_retry_wait() -> None:
    """Uploads in this process retry at once (the tries are what matters, not the wait)."""
    from ckptmgr import uploader

    real = uploader.Uploader.__init__

    def init(self: Any, *args: Any, **kw: Any) -> None:
        real(self, *args, **kw)
        self.retry_s = 0.0

    uploader.Uploader.__init__ = init  # type: ignore[method-assign]


def _phase(rank: int, world: int, durable: str, nodes: str, phase: str,
           times: int | None, replicas: bool = False) -> dict[str, Any]:
    kw: dict[str, Any] = {"local_interval": 5, "local_path": f"{nodes}/node{rank}"}
    if replicas:  # replicas asked for, but one node: no rank's part has a holder
        os.environ["GROUP_RANK"] = "0"
        kw["local_replicas"] = 1
    own = Path(nodes, f"node{rank}", f"rank-{rank}")
    _no_retry_wait()
    if phase in ("save", "restore"):  # step 10 saved on the local tier, its upload never runs
        with ckptmgr.CheckpointManager(durable, save_interval=10, **kw) as mgr:
            _owe_step_10(mgr)
            if phase == "save":
                return {}
            mgr.join()  # committed locally (its upload never runs)
            # Restored while owed: rank 1's read fails once, so the restore fails on every
            # rank (the local tier alone holds it); the next local save must keep it.
            if rank == 1 and times == 0:  # a flipped byte instead: a finding, not a read error
                data = next(p for p in (own / "10").iterdir() if p.name.startswith("data-"))
                raw = bytearray(data.read_bytes())
                raw[len(raw) // 2] ^= 0x40
                data.write_bytes(bytes(raw))
            elif rank == 1:
                _unreadable(nodes, 10, 1)
            with pytest.raises(CorruptCheckpointError) as err:
                mgr.restore(10, _target())
            mgr.save_async(15, _state(15))
            mgr.join()
            return {"kept": (own / "10" / "commit.json").exists(), "all": mgr.all_steps(),
                    "why": str(err.value)}
    if phase == "flaky" and rank == 1:
        _unreadable(nodes, 10, times)
    failed = None
    with ckptmgr.CheckpointManager(durable, save_interval=10, **kw) as mgr:
        for step in (15, 25):  # local only: each save's agreement applies local retention
            try:  # a copy that failed at construction is raised by the next save
                mgr.save_async(step, _state(step))
                mgr.join()
            except AsyncSaveError as e:
                failed = str(e)
        target = _target()
        restored = 10 in mgr.all_steps() and mgr.restore(10, target) is None
        return {"failed": failed, "kept": (own / "10" / "commit.json").exists(),
                "all": mgr.all_steps(), "restored": restored,
                "exact": _equal(target, _state(10))}


def _durable_steps(durable: str) -> list[int]:
    with ckptmgr.CheckpointManager(durable, save_interval=10, read_only=True) as reader:
        return reader.all_steps()


@pytest.mark.parametrize("times", [1, None], ids=["once", "until-restart"])
def test_an_owed_step_one_rank_cannot_read_is_kept_and_uploaded(tmp_path: Path,
                                                               times: int | None) -> None:
    # Step 10 is owed to the durable tier (its upload never ran). At the restart, rank 1's
    # read of its own copy fails with EIO: once (the restart's upload reads it), or every time
    # until the next restart. Before the fix the step was not whole, so not uploaded, and the
    # next local save's retention deleted it on both ranks: the only copy was lost.
    durable, nodes = str(tmp_path / "durable"), str(tmp_path / "nodes")
    run_ranks(_phase, 2, durable, nodes, "save", None, timeout_s=120)
    res = run_ranks(_phase, 2, durable, nodes, "flaky", times, timeout_s=120)
    if times == 1:  # uploaded by the restart: restored from the durable tier
        for r in res:
            assert r["failed"] is None and r["restored"] and r["exact"], r
        assert _durable_steps(durable) == [10]
        return
    # Its upload failed (raised once), its files stay on both ranks; never listed meanwhile.
    for r in res:
        assert r["failed"] is not None and "step 10" in r["failed"], r
        assert r["kept"] and r["all"][-1] == 25 and 10 not in r["all"], r
    assert _durable_steps(durable) == []
    res = run_ranks(_phase, 2, durable, nodes, "fixed", None, timeout_s=120)
    for r in res:
        assert r["failed"] is None and r["restored"] and r["exact"], r
    assert _durable_steps(durable) == [10]


@pytest.mark.parametrize("replicas", [False, True], ids=["", "replicas-no-holder"])
@pytest.mark.parametrize("damaged", [False, True], ids=["read-error", "flipped-byte"])
def test_an_owed_step_whose_restore_failed_on_a_read_error_is_kept(tmp_path: Path,
                                                                  damaged: bool,
                                                                  replicas: bool) -> None:
    # Step 10 is owed (its upload never runs in this job) and held only by the local tier. Its
    # restore fails because rank 1's read fails once: not restorable in this job, but before
    # the fix every rank deleted its part at the next local save. Now every rank keeps it; the
    # restart reads it whole and uploads it. A part found damaged (a flipped byte) is a
    # finding: the step goes on every rank at the next local save, as before. With replicas
    # asked for, rank 1's own copy fails its check before the read and no holder can heal it
    # (one node): before that fix every rank took it as damaged and deleted its part.
    durable, nodes = str(tmp_path / "durable"), str(tmp_path / "nodes")
    res = run_ranks(_phase, 2, durable, nodes, "restore", 0 if damaged else 1, replicas,
                    timeout_s=120)
    assert [(r["kept"], r["all"]) for r in res] == [(not damaged, [15])] * 2, res
    why = ("no verified copy" if replicas else "sizes and checksums") if damaged else (
        "rank 1: a read of its files failed (an I/O error)")
    assert all(why in r["why"] for r in res), res
    res = run_ranks(_phase, 2, durable, nodes, "fixed", None, replicas, timeout_s=120)
    for r in res:
        assert r["failed"] is None and r["restored"] is not damaged, r
        assert damaged or r["exact"], r
    assert _durable_steps(durable) == ([] if damaged else [10])


def test_an_owed_step_no_rank_can_read_is_kept_until_a_restart_can(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One rank (the whole job) cannot read step 10's files (its manifest aside) after the
    # restart: whether it is due cannot be told, so it is not copied, but it is kept (the next
    # local saves do not delete it) until a restart reads it and copies it.
    durable, nodes = str(tmp_path / "durable"), str(tmp_path / "nodes")
    own = Path(nodes, "node0", "rank-0")
    kw: dict[str, Any] = {"save_interval": 10, "local_interval": 5,
                          "local_path": f"{nodes}/node0"}
    with ckptmgr.CheckpointManager(durable, **kw) as mgr:
        assert mgr._uploads is not None
        mgr._uploads.close()  # as if the job died before the upload
        mgr.save_async(10, _state(10))
    _unreadable(nodes, 10, None, monkeypatch.setattr)
    with ckptmgr.CheckpointManager(durable, **kw) as mgr:
        for step in (15, 25):
            mgr.save_async(step, _state(step))
        mgr.join()
        assert mgr.all_steps() == [15, 25]
        assert (own / "10" / "commit.json").exists()
    monkeypatch.undo()
    with ckptmgr.CheckpointManager(durable, **kw) as mgr:
        mgr.join()
        assert mgr.step_info(10).tiers == ("durable",)  # copied; never listed locally again
        target = _target()
        mgr.restore(10, target)
        assert _equal(target, _state(10))
    assert _durable_steps(durable) == [10]


def _with_replicas(rank: int, world: int, durable: str, nodes: str, phase: str
                   ) -> dict[str, Any]:
    os.environ["GROUP_RANK"] = str(rank)  # one node per rank: each part held on the other
    kw: dict[str, Any] = {"local_interval": 5, "local_replicas": 1,
                          "local_path": f"{nodes}/node{rank}"}
    _no_retry_wait()
    if phase == "flaky" and rank == 1:
        _unreadable(nodes, 10, 1)
    with ckptmgr.CheckpointManager(durable, save_interval=10, **kw) as mgr:
        if phase == "save":
            _owe_step_10(mgr)
            return {}
        mgr.join()
        target = _target()
        mgr.restore(10, target)
        return {"tiers": mgr.step_info(10).tiers, "exact": _equal(target, _state(10))}


def test_an_owed_step_whole_by_a_replica_is_uploaded_when_the_own_copy_reads_again(
        tmp_path: Path) -> None:
    # With replicas, rank 1's part of step 10 is whole by node 0's replica while rank 1's own
    # read fails at the restart. Before, rank 1 refused to copy it at construction (its own
    # copy "did not verify"), so it was never uploaded; now a read error is not a refusal and
    # the copy reads rank 1's own files again (they read now).
    durable, nodes = str(tmp_path / "durable"), str(tmp_path / "nodes")
    run_ranks(_with_replicas, 2, durable, nodes, "save", timeout_s=120)
    res = run_ranks(_with_replicas, 2, durable, nodes, "flaky", timeout_s=120)
    assert [(r["tiers"], r["exact"]) for r in res] == [(("durable", "local"), True)] * 2, res
    assert _durable_steps(durable) == [10]


def _manifest_unreadable(nodes: str, step: int, times: int | None) -> None:
    """This process's reads of local ``step``'s manifest (``commit.json``) under ``nodes`` fail
    with EIO: the first ``times`` of them, or every one (None)."""
    from ckptmgr.storage import local

    real = local.LocalStorage.read_bytes
    left = [times]

    def read_bytes(self: Any, path: str, start: int = 0, length: int | None = None) -> bytes:
        if self.root.startswith(nodes) and path == f"{step}/commit.json" and left[0] != 0:
            if left[0] is not None:
                left[0] -= 1
            raise StorageError(f"read failed for {self.url}/{path} (injected)") from OSError(
                errno.EIO, "Input/output error (injected)", path)
        return real(self, path, start, length)

    local.LocalStorage.read_bytes = read_bytes  # type: ignore[method-assign]


class _Said(logging.Handler):
    """The ckptmgr warnings logged in this process."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said: list[str] = []
        logging.getLogger("ckptmgr").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


def _manifest_phase(rank: int, world: int, durable: str, nodes: str, phase: str,
                    times: int | None) -> dict[str, Any]:
    kw: dict[str, Any] = {"local_interval": 5, "local_path": f"{nodes}/node{rank}"}
    own = Path(nodes, f"node{rank}", f"rank-{rank}")
    _no_retry_wait()
    said = _Said()
    if phase == "flaky" and rank == 1:
        _manifest_unreadable(nodes, 10, times)
    failed = None
    with ckptmgr.CheckpointManager(durable, save_interval=10, **kw) as mgr:
        if phase == "save":
            _owe_step_10(mgr)
            return {}
        for step in (15, 25):
            try:  # a copy that failed at construction is raised by the next save
                mgr.save_async(step, _state(step))
                mgr.join()
            except AsyncSaveError as e:
                failed = str(e)
        return {"failed": failed, "kept": (own / "10" / "commit.json").exists(),
                "another_run": any("another run" in m for m in said.said),
                "manifest": any("cannot read step 10's manifest" in m for m in said.said)}


@pytest.mark.parametrize("times", [1, None], ids=["once", "until-restart"])
def test_an_owed_step_whose_manifest_one_rank_cannot_read_is_kept_and_uploaded(
        tmp_path: Path, times: int | None) -> None:
    # Step 10 is owed (its upload never ran). At the restart rank 1's read of its manifest
    # fails (EIO): whose step it is cannot be told there, so rank 1 leaves it alone, and
    # before the fix reported nothing of it: not whole, not in doubt, not uploaded, and the
    # next local save deleted it on both ranks (on rank 1 once it read again: "committed by no
    # save"). Now rank 1 reports a copy it could not read: the step is uploaded by the restart
    # when the manifest reads again, else kept on both ranks until a restart can.
    durable, nodes = str(tmp_path / "durable"), str(tmp_path / "nodes")
    run_ranks(_manifest_phase, 2, durable, nodes, "save", None, timeout_s=120)
    res = run_ranks(_manifest_phase, 2, durable, nodes, "flaky", times, timeout_s=120)
    assert res[1]["manifest"] and not any(r["another_run"] for r in res), res
    if times == 1:
        assert [r["failed"] for r in res] == [None, None], res
        assert _durable_steps(durable) == [10]
        return
    for r in res:
        assert r["kept"] and r["failed"] is not None and "step 10" in r["failed"], r
    assert _durable_steps(durable) == []
    res = run_ranks(_manifest_phase, 2, durable, nodes, "fixed", None, timeout_s=120)
    assert [r["failed"] for r in res] == [None, None], res
    assert _durable_steps(durable) == [10]


def _replicas_session(rank: int, world: int, durable: str, nodes: str, phase: str
                      ) -> dict[str, Any]:
    os.environ["GROUP_RANK"] = str(rank)  # one node per rank: each part held on the other
    kw: dict[str, Any] = {"local_interval": 5, "local_replicas": 1, "local_max_to_keep": 1,
                          "local_path": f"{nodes}/node{rank}"}
    own = Path(nodes, f"node{rank}", f"rank-{rank}")
    replica = Path(nodes, f"node{rank}", f"rank-{rank}", "replicas", f"rank-{1 - rank}")
    _no_retry_wait()
    if phase == "flaky" and rank == 1:
        _unreadable(nodes, 10, None)  # every read of step 10 here, this whole session
    failed = None
    with ckptmgr.CheckpointManager(durable, save_interval=10, **kw) as mgr:
        if phase == "save":
            _owe_step_10(mgr)
            return {}
        for step in (15, 25):  # local only; step 10 leaves the listing (keep 1)
            try:  # a copy that failed at construction is raised by the next save
                mgr.save_async(step, _state(step))
                mgr.join()
            except AsyncSaveError as e:
                failed = str(e)
        return {"failed": failed, "kept": (own / "10" / "commit.json").exists(),
                "replica": (replica / "10" / "commit.json").exists()}


def test_an_owed_step_whole_by_a_replica_while_a_rank_cannot_read_its_own_is_kept(
        tmp_path: Path) -> None:
    # Step 10 is owed; at the restart rank 1 cannot read its own copy this whole session, but
    # node 0's replica of it verifies, so the step is whole. Its upload (own copies only) fails
    # on rank 1. Before the fix, the next local save deleted rank 1's own copy (it did not
    # verify), and once step 10 left the listing the replicas went too: the only copy of
    # rank 1's part was lost, and step 10 was never uploaded. Now both stay while it is owed;
    # the next restart reads it and uploads it.
    durable, nodes = str(tmp_path / "durable"), str(tmp_path / "nodes")
    run_ranks(_replicas_session, 2, durable, nodes, "save", timeout_s=120)
    res = run_ranks(_replicas_session, 2, durable, nodes, "flaky", timeout_s=120)
    for r in res:
        assert r["failed"] is not None and "step 10" in r["failed"], r
        assert r["kept"] and r["replica"], r
    assert _durable_steps(durable) == []
    res = run_ranks(_replicas_session, 2, durable, nodes, "fixed", timeout_s=120)
    assert [r["failed"] for r in res] == [None, None], res
    assert _durable_steps(durable) == [10]


def _resume(rank: int, world: int, durable: str, nodes: str, phase: str) -> dict[str, Any]:
    kw: dict[str, Any] = {"local_interval": 5, "local_path": f"{nodes}/node{rank}"}
    _no_retry_wait()
    if phase == "flaky" and rank == 1:
        _unreadable(nodes, 10, 1)
    with ckptmgr.CheckpointManager(durable, save_interval=10, **kw) as mgr:
        if phase == "save":
            _owe_step_10(mgr)
            return {}
        listed = mgr.all_steps()
        target = _target()
        return {"listed": listed, "latest": mgr.restore_latest(target),
                "exact": _equal(target, _state(10))}


def test_a_resuming_job_finds_the_owed_step_its_restart_uploads(tmp_path: Path) -> None:
    # Step 10 is owed; at the restart rank 1's first read of it fails, so it is not listed
    # from the local tier (in doubt) but its copy is queued. Before, the constructor returned
    # before the copy was made: all_steps() was [] and restore_latest() None, so a resuming
    # job started from scratch (and its next save of step 10 met the old run's). Now the
    # constructor waits for a queued copy newer than every listed step.
    durable, nodes = str(tmp_path / "durable"), str(tmp_path / "nodes")
    run_ranks(_resume, 2, durable, nodes, "save", timeout_s=120)
    res = run_ranks(_resume, 2, durable, nodes, "flaky", timeout_s=120)
    assert res == [{"listed": [10], "latest": 10, "exact": True}] * 2, res


def test_an_owed_step_restored_into_a_state_that_does_not_match_is_kept(tmp_path: Path) -> None:
    # Step 10 is owed and held only by the local tier. A restore into a state with a key the
    # checkpoint lacks is the caller's mistake, not the step's: before, it was taken as a
    # finding (CorruptCheckpointError), the step delisted and deleted at the next local save.
    # Now the real error is raised and the step stays listed, restorable and kept.
    durable, nodes = str(tmp_path / "durable"), str(tmp_path / "nodes")
    own = Path(nodes, "rank-0")
    kw: dict[str, Any] = {"save_interval": 10, "local_interval": 5, "local_path": nodes}
    with ckptmgr.CheckpointManager(durable, **kw) as mgr:
        assert mgr._uploads is not None
        mgr._uploads.close()  # its upload never runs in this job
        mgr.save_async(10, _state(10))
        mgr.join()
        with pytest.raises(StateMismatchError, match="missing"):
            mgr.restore(10, {**_target(), "missing": torch.zeros(1)})
        mgr.save_async(15, _state(15))
        mgr.join()
        assert mgr.all_steps() == [10, 15] and (own / "10" / "commit.json").exists()
        target = _target()
        mgr.restore(10, target)
        assert _equal(target, _state(10))


def _other_layout(rank: int, world: int, durable: str, nodes: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8.0)
    kw: dict[str, Any] = {"local_interval": 5, "local_path": f"{nodes}/node{rank}"}
    with ckptmgr.CheckpointManager(durable, save_interval=10, **kw) as mgr:
        assert mgr._uploads is not None
        mgr._uploads.close()  # its upload never runs in this job
        mgr.save_async(10, {"w": distribute_tensor(full, mesh, [Shard(0)])})
        mgr.join()
        err = None
        try:
            mgr.restore(10, {"w": distribute_tensor(torch.zeros(8), mesh, [Replicate()])})
        except ckptmgr.CkptmgrError as e:
            err = type(e).__name__
        mgr.save_async(15, {"w": distribute_tensor(full, mesh, [Shard(0)])})
        mgr.join()
        target = {"w": distribute_tensor(torch.zeros(8), mesh, [Shard(0)])}
        mgr.restore(10, target)
        return {"err": err, "all": mgr.all_steps(),
                "exact": torch.equal(target["w"].full_tensor(), full)}


def test_an_owed_step_restored_into_another_layout_is_kept(tmp_path: Path) -> None:
    # The local tier puts a DTensor back only into the layout it was saved with; until its
    # durable copy is made, a restore into another layout fails with StateMismatchError (the
    # target's doing) and the step stays listed and kept (before: CorruptCheckpointError, and
    # the step was deleted on every rank at the next local save).
    durable, nodes = str(tmp_path / "durable"), str(tmp_path / "nodes")
    res = run_ranks(_other_layout, 2, durable, nodes, timeout_s=120)
    assert res == [{"err": "StateMismatchError", "all": [10, 15], "exact": True}] * 2, res
