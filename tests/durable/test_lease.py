"""The writer lease (issue 15): one job writes a root at a time; readers work beside it.

Every case that involves two jobs runs the other job in a real spawned process
(:class:`_procs.Holder`) and orders the two with blocking calls and file gates, never sleeps.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import time
from typing import Any

import pytest
import torch
from _procs import Holder, restored_version, state, wait_for_file

from ckptmgr import CheckpointManager
from ckptmgr.errors import CkptmgrError, ConfigError, LeaseError
from ckptmgr.lease import LEASE_NAME


def _lease(root: str) -> dict[str, Any]:
    with open(os.path.join(root, LEASE_NAME), "rb") as f:
        return json.load(f)  # type: ignore[no-any-return]


def _entries(root: str) -> set[str]:
    """Every name under ``root``, relative, directories included."""
    out: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for n in [*dirnames, *filenames]:
            out.add(n if rel == "." else f"{rel}/{n}")
    return out


def _step_entries(root: str, step: int) -> set[str]:
    """Whatever a save of ``step`` left: its directory or a staging directory for it."""
    return {e for e in _entries(root)
            if e.split("/")[0] == str(step) or e.startswith(f".tmp-{step}-")}


@pytest.fixture
def holders() -> Any:
    started: list[Holder] = []
    yield started
    for h in started:
        h.stop()


def test_second_writer_refused_reader_beside_take_over_fences(local_root: str,
                                                              holders: list[Holder]) -> None:
    a = Holder(local_root)
    holders.append(a)
    assert a.status == "ok", a.value
    assert a.ok("save", 1, 1) is True
    lease = _lease(local_root)
    assert lease["pid"] == a.pid and lease["host"] == socket.gethostname()
    assert lease["expires"] > time.time()

    # A second writer on the live root: refused, naming the holder, the expiry and the way out.
    with pytest.raises(LeaseError) as ei:
        CheckpointManager(local_root, save_interval=1)
    msg = str(ei.value)
    assert isinstance(ei.value, CkptmgrError) and isinstance(ei.value, RuntimeError)
    assert f"pid {a.pid}" in msg and socket.gethostname() in msg, msg
    assert "expires in" in msg and "read_only=True" in msg and "take_over=True" in msg, msg
    assert _lease(local_root)["id"] == lease["id"]  # the refused writer changed nothing

    # A reader works beside the writer and never touches the lease.
    with CheckpointManager(local_root, save_interval=1, read_only=True) as reader:
        assert reader.all_steps() == [1]
        assert reader.step_info(1).step == 1
        assert restored_version(reader, 1) == 1
        for call in (reader.save, reader.save_async):
            with pytest.raises(ConfigError, match="read_only"):
                call(2, state(2))
            with pytest.raises(ConfigError, match="read_only"):
                call(2, state(2), force=True)
        assert a.ok("save", 2, 2) is True  # the writer goes on meanwhile
    assert _lease(local_root)["id"] == lease["id"]
    assert sorted(os.listdir(local_root)) == [LEASE_NAME, "1", "2"]

    # take_over=True takes the live lease; the old writer's next save is fenced.
    with CheckpointManager(local_root, save_interval=1, take_over=True) as b:
        mine = _lease(local_root)
        assert mine["pid"] == os.getpid() and mine["id"] != lease["id"]
        status, (kind, text) = a.call("save", 3, 3)
        assert (status, kind) == ("err", "LeaseError"), text
        assert "lost its lease" in text and "nothing of this save became visible" in text
        assert _step_entries(local_root, 3) == set()
        assert b.all_steps() == [1, 2]
        # The fenced writer's close() leaves the new holder's lease alone.
        assert a.ok("close") is None
        assert _lease(local_root)["id"] == mine["id"]
        assert b.save(3, state(30)) is True
        assert restored_version(b, 3) == 30
    assert not os.path.exists(os.path.join(local_root, LEASE_NAME))  # released by close()


def test_fenced_writer_commit_fails_with_nothing_visible(local_root: str, tmp_path: Any,
                                                         holders: list[Holder]) -> None:
    """The take-over happens while the old writer's save is in flight (data files being
    written): its commit, the fence, fails; the fenced writer removes nothing, not even its own
    attempt (every removal is fenced), and the new holder removes that leftover after its
    next commit."""
    gate = str(tmp_path / "gate")
    os.makedirs(gate)
    a = Holder(local_root, gate_dir=gate)
    holders.append(a)
    assert a.ok("save", 1, 1) is True
    open(os.path.join(gate, "armed"), "w").close()
    a.send("save", 2, 2)
    wait_for_file(os.path.join(gate, "arrived"))  # step 2's data files are being written
    assert any(e.startswith(".tmp-2-") for e in _entries(local_root))
    with CheckpointManager(local_root, save_interval=1, take_over=True) as b:
        open(os.path.join(gate, "open"), "w").close()
        status, (kind, text) = a.answer()
        assert (status, kind) == ("err", "LeaseError"), text
        assert not os.path.exists(os.path.join(local_root, "2")), "the fenced attempt committed"
        assert b.all_steps() == [1]
        assert b.save(2, state(20)) is True
        assert restored_version(b, 2) == 20
        assert not any(e.startswith(".tmp-") for e in _entries(local_root)), \
            "the new holder left the fenced writer's leftover"


def test_take_over_after_sigkill_of_the_holder(local_root: str, holders: list[Holder]) -> None:
    a = Holder(local_root)
    holders.append(a)
    assert a.ok("save", 1, 1) is True
    os.kill(a.pid, signal.SIGKILL)
    a.proc.join(timeout=30)  # reaped: the pid is gone
    assert a.proc.exitcode == -signal.SIGKILL
    assert _lease(local_root)["pid"] == a.pid  # the dead holder's lease is still there
    # Same host, pid gone: the restarted job just starts, no take_over, no waiting for the TTL.
    with CheckpointManager(local_root, save_interval=1) as mgr:
        assert _lease(local_root)["pid"] == os.getpid()
        assert mgr.all_steps() == [1]
        assert restored_version(mgr, 1) == 1
        assert mgr.save(2, state(2)) is True


def test_expired_lease_is_taken_over_and_its_holder_fenced(local_root: str,
                                                           holders: list[Holder]) -> None:
    """A holder that is alive but stopped (SIGSTOP: no renewal) loses its lease at expiry; after
    SIGCONT its save fails."""
    a = Holder(local_root, env={"CKPTMGR_LEASE_TTL_S": "0.5"})
    holders.append(a)
    assert a.ok("save", 1, 1) is True
    os.kill(a.pid, signal.SIGSTOP)
    try:
        expires = _lease(local_root)["expires"]  # no renewal can move it any more
        assert expires - time.time() < 1.0
        while time.time() <= expires:  # waiting for the clock itself, which is what expiry is
            time.sleep(expires - time.time() + 0.01)
        with CheckpointManager(local_root, save_interval=1) as mgr:  # no take_over needed
            assert _lease(local_root)["pid"] == os.getpid()
            os.kill(a.pid, signal.SIGCONT)
            status, (kind, text) = a.call("save", 2, 2)
            assert (status, kind) == ("err", "LeaseError"), text
            assert _step_entries(local_root, 2) == set()
            assert mgr.save(2, state(20)) is True
            assert _lease(local_root)["pid"] == os.getpid()  # the old holder renewed nothing
    finally:
        os.kill(a.pid, signal.SIGCONT)


def test_lease_is_renewed_while_idle(local_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long phase without saves (an evaluation) keeps the lease: renewal is a thread."""
    monkeypatch.setenv("CKPTMGR_LEASE_TTL_S", "0.3")
    with CheckpointManager(local_root, save_interval=1) as mgr:
        first = _lease(local_root)
        deadline = time.monotonic() + 30
        while _lease(local_root)["expires"] <= first["expires"]:  # the renewal thread's write
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.02)
        assert _lease(local_root)["id"] == first["id"]
        while time.time() <= first["expires"]:  # past the first expiry: still ours
            time.sleep(first["expires"] - time.time() + 0.01)
        assert mgr.save(1, state(1)) is True
        with pytest.raises(LeaseError, match="close\\(\\) it first"):
            CheckpointManager(local_root, save_interval=1)
    assert not os.path.exists(os.path.join(local_root, LEASE_NAME))


def test_unreadable_lease_is_taken_over(local_root: str) -> None:
    """A lease file that does not parse (a torn write of an older version) holds nobody."""
    os.makedirs(local_root)
    with open(os.path.join(local_root, LEASE_NAME), "wb") as f:
        f.write(b'{"id": "abc", "host":')
    with CheckpointManager(local_root, save_interval=1) as mgr:
        assert _lease(local_root)["pid"] == os.getpid()
        assert mgr.save(1, {"x": torch.ones(2)}) is True


def test_a_manager_dropped_without_close_lets_the_lease_go(local_root: str) -> None:
    mgr = CheckpointManager(local_root, save_interval=1)
    mgr.save(1, state(1))
    del mgr  # no close(): the lease names this live process, but its manager is gone
    gc.collect()
    with CheckpointManager(local_root, save_interval=1) as again:
        assert again.all_steps() == [1]


@pytest.mark.parametrize("raw", ["abc", "0", "-5"])
def test_bad_lease_ttl_is_a_config_error(local_root: str, monkeypatch: pytest.MonkeyPatch,
                                         raw: str) -> None:
    monkeypatch.setenv("CKPTMGR_LEASE_TTL_S", raw)
    with pytest.raises(ConfigError, match="CKPTMGR_LEASE_TTL_S"):
        CheckpointManager(local_root, save_interval=1)
    # A reader takes no lease, so it does not care.
    with CheckpointManager(local_root, save_interval=1, read_only=True) as reader:
        assert reader.all_steps() == []


@pytest.mark.parametrize("same_namespace", [True, False])
def test_a_dead_pid_is_provably_dead_only_in_our_pid_namespace(local_root: str,
                                                                 same_namespace: bool) -> None:
    """Containers on one host can share a host name: a pid that is gone here may be alive in
    another PID namespace, so only a holder of our namespace (and boot) is provably dead."""
    import subprocess

    from ckptmgr.lease import _pid_namespace

    proc = subprocess.Popen(["true"])
    proc.wait()  # a pid that no longer exists here
    os.makedirs(local_root)
    now = time.time()
    ns = _pid_namespace() if same_namespace else "pid:[4026531999]@another-container"
    with open(os.path.join(local_root, LEASE_NAME), "w") as f:
        json.dump({"id": "0123456789abcdef", "host": socket.gethostname(), "pid": proc.pid,
                   "job": None, "since": now, "expires": now + 600, "pid_ns": ns}, f)
    if same_namespace:
        with CheckpointManager(local_root, save_interval=1) as mgr:  # taken over
            mgr.save(0, {"w": torch.ones(2)})
    else:
        with pytest.raises(LeaseError, match="expires in"):
            CheckpointManager(local_root, save_interval=1)


def _save_async_held_at_commit(mgr: CheckpointManager, monkeypatch: pytest.MonkeyPatch,
                               ) -> tuple[Any, Any]:
    """Start ``save_async`` of step 2 and hold it at its commit until the returned gate is set;
    also returns the real ``StepStore.commit`` (to put back before another manager commits)."""
    import threading

    from ckptmgr.step_store import StepStore

    entered, gate = threading.Event(), threading.Event()
    commit = StepStore.commit

    def gated_commit(self: StepStore, *args: Any, **kwargs: Any) -> Any:
        entered.set()
        gate.wait(60)
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(StepStore, "commit", gated_commit)
    mgr.save_async(2, state(2))
    assert entered.wait(60)
    return gate, commit


def test_a_save_left_running_by_an_interrupted_close_removes_nothing(
        local_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # close() interrupted while it waits for the save in flight (Ctrl-C) releases the lease;
    # the save goes on in its thread, and the next job may write the root by then: retention
    # of that save must be fenced by the released lease, not run unchecked.
    import contextlib

    mgr = CheckpointManager(local_root, 1, max_to_keep=1)
    mgr.save(1, state(1))
    gate, commit = _save_async_held_at_commit(mgr, monkeypatch)
    join = mgr.join

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(mgr, "join", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mgr.close()
    monkeypatch.setattr("ckptmgr.step_store.StepStore.commit", commit)
    with CheckpointManager(local_root, 1, save_on_close=False) as nxt:  # the next job
        assert nxt.all_steps() == [1]
        gate.set()
        with contextlib.suppress(CkptmgrError):
            join()  # the old save ends (its retention stops at the released lease)
        assert os.path.isdir(os.path.join(local_root, "1")), "the next job's step was removed"
        assert restored_version(nxt, 1) == 1


def test_a_background_save_fenced_by_a_take_over_names_its_step(
        local_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptmgr.errors import AsyncSaveError

    mgr = CheckpointManager(local_root, 1, save_on_close=False)
    mgr.save(1, state(1))
    gate, commit = _save_async_held_at_commit(mgr, monkeypatch)
    monkeypatch.setattr("ckptmgr.step_store.StepStore.commit", commit)
    with CheckpointManager(local_root, 1, take_over=True, save_on_close=False) as nxt:
        gate.set()
        with pytest.raises(AsyncSaveError, match="background save of step 2 failed") as info:
            mgr.join()
        assert info.value.step == 2 and isinstance(info.value.__cause__, LeaseError)
        assert nxt.all_steps() == [1]
    mgr.close()
