"""The local byte path chosen by measurement: direct or buffered writes, per file system."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

from ckptmgr import CheckpointManager
from ckptmgr.storage import local
from ckptmgr.storage.local import LocalStorage

MIB = 1 << 20


def _direct_supported(path: Path) -> bool:
    try:
        fd = os.open(path / "o_direct_check", os.O_WRONLY | os.O_CREAT | local._O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    os.unlink(path / "o_direct_check")
    return bool(local._O_DIRECT)


def test_chooser_alternates_then_takes_the_faster_path_and_explores() -> None:
    c = local._PathChooser()
    big = local._MEASURE_MIN
    # Small or unknown files are not timed and take the default (direct) until measured.
    assert c.choose(None) == (True, False) and c.choose(big - 1) == (True, False)
    first = []
    for i in range(5):
        direct, timed = c.choose(big)
        assert timed == (i > 0)  # the first large file handed out is the warm-up: not timed
        first.append(direct)
        if timed:
            c.record(direct, big, 1.0 if direct else 0.5)  # buffered twice as fast
    assert first == [True, True, False, True, False]
    assert c._speeds[True] == [big / 1.0, big / 1.0]
    # Files written together: the warm-up is the first handed out, whichever ends first.
    together = local._PathChooser()
    picks = [together.choose(big) for _ in range(3)]
    assert picks == [(True, False), (True, True), (True, True)]
    assert c.choose(None) == (False, False)  # small files follow the faster path
    picks = [c.choose(big)[0] for _ in range(2 * local._EXPLORE_EVERY)]
    # Every 16th large file (counting the first five) tries the other path.
    assert picks.count(True) == 2 and picks.count(False) == 2 * local._EXPLORE_EVERY - 2
    # A changed disk: recent direct files now faster; the last _RECENT decide.
    for _ in range(local._RECENT):
        c.record(True, big, 0.1)
    assert c.choose(big)[0] is True
    # Within 5%: direct (less CPU, no page cache).
    tie = local._PathChooser()
    for direct in (True, False, True, False):
        tie.record(direct, big, 1.0 if direct else 1.0 / 1.04)
    assert tie.choose(None) == (True, False)
    tie.record(True, big - 1, 0.001)  # too small to count
    assert tie._speeds[True] == [big / 1.0, big / 1.0]


def test_open_writer_follows_the_chooser_and_the_override(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not _direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    monkeypatch.setattr(local, "_CHOOSERS", {})
    monkeypatch.setattr(local, "_MEASURE_MIN", 64 << 10)
    monkeypatch.setattr(local, "DIRECT_IO", None)
    storage = LocalStorage(str(tmp_path))
    kinds = []
    for i in range(5):
        w = storage.open_writer(f"f{i}", size_hint=128 << 10)
        kinds.append(type(w))
        w.write(os.urandom(128 << 10))
        w.commit()
        assert (tmp_path / f"f{i}").stat().st_size == 128 << 10
    assert kinds == [local._DirectWriter] + [local._DirectWriter, local._LocalWriter] * 2
    chooser = local._chooser_for(str(tmp_path))
    assert chooser is not None
    assert len(chooser._speeds[True]) == len(chooser._speeds[False]) == 2
    # An aborted file is not a measurement.
    storage.open_writer("gone", size_hint=128 << 10).abort()
    assert sum(map(len, chooser._speeds.values())) == 4
    # The override wins over the measurements, both ways; its files are not timed.
    monkeypatch.setattr(local, "DIRECT_IO", False)
    w = storage.open_writer("forced", size_hint=128 << 10)
    assert isinstance(w, local._LocalWriter) and w._timer is None
    w.abort()
    monkeypatch.setattr(local, "DIRECT_IO", True)
    w = storage.open_writer("forced", size_hint=128 << 10)
    assert isinstance(w, local._DirectWriter) and w._timer is None
    w.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f0", "f1", "f2", "f3", "f4"]


def test_saves_on_both_paths_restore_bit_exact(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps written direct (padded) and buffered (unpadded) by one manager all restore, and the
    choice leaves nothing in the root but the steps."""
    monkeypatch.setattr(local, "_CHOOSERS", {})
    monkeypatch.setattr(local, "_MEASURE_MIN", 256 << 10)
    monkeypatch.setattr(local, "DIRECT_IO", None)
    g = torch.Generator().manual_seed(3)
    root = tmp_path / "run"
    with CheckpointManager(str(root), save_interval=1) as mgr:
        states = {}
        for step in range(1, 5):
            states[step] = {f"t{i}": torch.randn(70_000 + i, generator=g) for i in range(3)}
            mgr.save(step, states[step])
        for step, state in states.items():
            out = {k: torch.zeros_like(v) for k, v in state.items()}
            mgr.restore(step, out)
            assert all(torch.equal(state[k], out[k]) for k in state), step
        assert mgr.all_steps() == [1, 2, 3, 4]
    assert {p.name for p in root.iterdir()} >= {"1", "2", "3", "4"}
    assert not [p.name for p in root.iterdir() if "probe" in p.name]


def test_a_child_forked_while_a_lock_is_held_still_chooses(tmp_path: Path) -> None:
    """A process forked while another thread held the choosers' lock, or a chooser's, starts with
    fresh locks (found by review: the child inherited them locked and hung at its first large
    file)."""
    chooser = local._chooser_for(str(tmp_path))
    assert chooser is not None
    with local._CHOOSERS_LOCK, chooser._lock:
        pid = os.fork()
        if pid == 0:  # the child: must not block on either inherited lock
            try:
                child = local._chooser_for(str(tmp_path))
                ok = child is not None and child is not chooser and child.choose(None)
                os._exit(0 if ok else 3)
            except BaseException:
                os._exit(4)
    for _ in range(1000):  # about 10 s; a hung child is killed and the test fails
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        threading.Event().wait(0.01)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on an inherited lock")
    assert os.waitstatus_to_exitcode(status) == 0
