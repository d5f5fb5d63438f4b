"""Trust I regressions at the seams of lease, deletion and the local tier (issue 25: defects 1, 2,
7, 11, 12 and the lease part of 13). Each test failed on the code before the fix."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _mp import run_ranks

import ckptmgr
from ckptmgr.errors import CkptmgrError, CorruptCheckpointError, SaveError, StorageError
from ckptmgr.lease import LEASE_NAME, _pid_namespace
from ckptmgr.step_store import StepStore


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((64,), float(v)), "extra": {"v": v}}


# ---------------------------------------------------------------------------------- defect 1


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


# ---------------------------------------------------------------------------------- defect 2


def _resave_fails_on_rank_1(rank: int, world: int, root: str, nodes: str) -> Any:
    import ckptmgr.tiers as tiers

    local = os.path.join(nodes, f"node{rank}")
    state = _state(0)
    out: dict[str, Any] = {}
    with ckptmgr.CheckpointManager(root, save_interval=1000, local_path=local,
                                   local_interval=1) as m:
        state["w"].fill_(1.0)
        assert m.save(1, state)
        state["w"].fill_(2.0)
        real = tiers.write_step
        if rank == 1:
            def disk_full(*args: Any, **kwargs: Any) -> Any:
                raise OSError(28, "No space left on device (injected)")
            tiers.write_step = disk_full  # type: ignore[assignment]
        try:
            m.save(1, state)
            out["resave"] = "ok"
        except SaveError as e:
            out["resave"] = f"SaveError: {e}"
        finally:
            tiers.write_step = real  # type: ignore[assignment]
        out["listed"] = m.all_steps()
    with ckptmgr.CheckpointManager(root, save_interval=1000, local_path=local,
                                   local_interval=1) as m:
        out["listed_after_restart"] = m.all_steps()
        if 1 in out["listed_after_restart"]:
            target = _state(0)
            m.restore(1, target)
            out["value"] = float(target["w"][0])
    return out


def test_local_step_whose_resave_failed_on_one_rank_is_whole_nowhere(tmp_path: Path) -> None:
    res = run_ranks(_resave_fails_on_rank_1, 2, str(tmp_path / "root"), str(tmp_path / "nodes"),
                    timeout_s=120)
    for r in res:
        assert r["resave"].startswith("SaveError"), res
        assert 1 not in r["listed"], res
        assert 1 not in r["listed_after_restart"], res


# ---------------------------------------------------------------------------------- defect 7


def _write_lease(root: Path, **fields: Any) -> None:
    doc = {"id": "0123456789abcdef", "host": socket.gethostname(), "pid": os.getpid(),
           "job": None, "since": time.time(), "expires": time.time() + 3600,
           "pid_ns": _pid_namespace()}
    doc.update(fields)
    root.mkdir(parents=True, exist_ok=True)
    (root / LEASE_NAME).write_text(json.dumps(doc))


@pytest.mark.parametrize("pid", [2**70, -1, 0, 2**31])
def test_lease_naming_an_impossible_pid_is_taken_over(tmp_path: Path, pid: int,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    if _pid_namespace() is None:
        pytest.skip("pids compare only where the PID namespace is known (Linux)")
    _write_lease(tmp_path / "r", pid=pid)
    with ckptmgr.CheckpointManager(str(tmp_path / "r"), save_interval=1) as m:
        assert m.save(1, _state(1))
    assert "no process" in caplog.text


@pytest.mark.parametrize("doc", [
    {"expires": float("nan")}, {"expires": "soon"}, {"pid": True}, {"pid": "12"},
    {"host": ["h"]}, {"id": 5},
])
def test_lease_with_malformed_fields_is_unreadable_not_live(tmp_path: Path,
                                                            doc: dict[str, Any]) -> None:
    path = tmp_path / "r"
    _write_lease(path, **{"host": "elsewhere", **doc})  # live elsewhere, if it parsed
    with ckptmgr.CheckpointManager(str(path), save_interval=1) as m:  # taken over, no crash
        assert m.save(1, _state(1))


def test_deeply_nested_lease_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / LEASE_NAME).write_text("[" * 100_000)
    with ckptmgr.CheckpointManager(str(tmp_path / "r"), save_interval=1) as m:
        assert m.save(1, _state(1))


# --------------------------------------------------------------------------------- defect 11


@pytest.mark.parametrize("damage", ["flip", "manifest", "truncate"])
def test_local_only_step_damaged_while_open_is_corrupt_and_target_untouched(
        tmp_path: Path, damage: str) -> None:
    local = tmp_path / "local"
    with ckptmgr.CheckpointManager(str(tmp_path / "root"), save_interval=100,
                                   local_path=str(local), local_interval=5) as m:
        assert m.save(5, _state(5))
        assert m.all_steps() == [5]
        sdir = local / "rank-0" / "5"
        data = sorted(p for p in sdir.iterdir() if p.name.startswith("data-"))[0]
        if damage == "flip":
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            data.write_bytes(bytes(raw))
        elif damage == "manifest":
            (sdir / "commit.json").unlink()
        else:
            data.write_bytes(data.read_bytes()[:-8])
        target = _state(-1)
        with pytest.raises(CorruptCheckpointError, match="local tier"):
            m.restore(5, target)
        assert torch.equal(target["w"], torch.full((64,), -1.0)), "damaged bytes reached it"


# --------------------------------------------------------------------------------- defect 12


def test_local_directory_wiped_while_open_saves_continue(tmp_path: Path) -> None:
    local = tmp_path / "local"
    with ckptmgr.CheckpointManager(str(tmp_path / "root"), save_interval=2,
                                   local_path=str(local), local_interval=1) as m:
        assert m.save(1, _state(1))
        shutil.rmtree(local)
        for step in range(2, 6):
            assert m.save(step, _state(step)), step
        assert m.all_steps()[-1] == 5
        target = _state(0)
        m.restore(5, target)
        assert float(target["w"][0]) == 5.0


def test_lease_expired_while_nobody_took_it_is_taken_back(tmp_path: Path) -> None:
    """A storage outage longer than the lease's time to live: renewals failed, the lease
    expired, nobody took it: the writer saves again afterwards."""
    root = tmp_path / "root"
    with ckptmgr.CheckpointManager(str(root), save_interval=1) as m:
        assert m.save(1, _state(1))
        doc = json.loads((root / LEASE_NAME).read_text())
        doc["expires"] = time.time() - 600
        (root / LEASE_NAME).write_text(json.dumps(doc))
        assert m.save(2, _state(2))
        assert m.all_steps() == [1, 2]
        assert json.loads((root / LEASE_NAME).read_text())["expires"] > time.time()


# ------------------------------------------------------------------------ defect 13 (lease)


def test_fifo_at_the_lease_name_fails_fast(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / LEASE_NAME)
    code = ("import ckptmgr, sys\n"
            "try:\n"
            f"    ckptmgr.CheckpointManager({str(root)!r}, save_interval=1)\n"
            "except ckptmgr.errors.CkptmgrError as e:\n"
            "    print(type(e).__name__, e); sys.exit(0)\n"
            "sys.exit(1)\n")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the constructor blocked on a FIFO")
    assert done.returncode == 0, done.stderr
    assert "not a regular file" in done.stdout


def test_local_reads_refuse_non_regular_files(tmp_path: Path) -> None:
    from ckptmgr.storage import open_storage

    os.mkfifo(tmp_path / "f")
    storage = open_storage(str(tmp_path))
    got: list[BaseException | bytes] = []

    def read() -> None:
        try:
            got.append(storage.read_bytes("f"))
        except BaseException as e:
            got.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=60)
    if reader.is_alive():  # blocked in open(): a writer end releases it, then fail
        fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail("reading a FIFO blocked")
    assert isinstance(got[0], StorageError) and "FIFO" in str(got[0]), got
    assert isinstance(got[0], CkptmgrError)
