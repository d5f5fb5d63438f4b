"""The lease file as read from storage (``<root>/.ckptmgr-lease.json``): impossible pids, malformed
or deeply nested fields, an expired lease nobody took, and a FIFO at its name."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptmgr
from ckptmgr.lease import LEASE_NAME, _pid_namespace


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((64,), float(v)), "extra": {"v": v}}


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
