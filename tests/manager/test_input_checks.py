"""What the manager accepts: strict flags (no pickle for a ``trusted`` that is not a bool), steps
that are integral numbers a listing can name, and a failed constructor leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptmgr import CheckpointManager, ConfigError, UnsafeCheckpointError
from ckptmgr.codec.layout import MAX_STEP


class Planted:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (self.path,)


@pytest.mark.parametrize("flag", ["false", "no", "0", 1.0, [False], 1, None])
def test_non_bool_trusted_runs_no_pickle(tmp_path: Path, flag: Any) -> None:
    sentinel = tmp_path / "ran"
    with CheckpointManager(str(tmp_path / "run"), save_interval=1) as mgr:
        mgr.save(1, {"obj": Planted(str(sentinel))}, trusted=True)
        assert not sentinel.exists()
        with pytest.raises(ConfigError, match="trusted must be a bool"):
            mgr.restore(1, {"obj": None}, trusted=flag)
        with pytest.raises(ConfigError, match="allow_partial must be a bool"):
            mgr.restore(1, {"obj": None}, allow_partial=flag)
        with pytest.raises(ConfigError, match="force must be a bool"):
            mgr.save(2, {"w": torch.ones(1)}, force=flag)
        with pytest.raises(UnsafeCheckpointError):
            mgr.restore(1, {"obj": None})
    assert not sentinel.exists()


def test_steps_are_integral_numbers_that_can_be_listed(tmp_path: Path) -> None:
    with CheckpointManager(str(tmp_path / "run"), save_interval=1) as mgr:
        assert mgr.save(np.int64(3), {"w": torch.ones(1)}) is True
        assert mgr.save(torch.tensor(4), {"w": torch.ones(1)}) is True
        assert mgr.save(MAX_STEP, {"w": torch.ones(1)}) is True
        assert mgr.all_steps() == [3, 4, MAX_STEP]
        for bad in (10**19, MAX_STEP + 1, -1, True, np.bool_(True), 2.0, torch.tensor(1.5)):
            with pytest.raises(ConfigError):
                mgr.save(bad, {"w": torch.ones(1)})
        out = {"w": torch.zeros(1)}
        mgr.restore(np.int64(4), out)
        assert mgr.step_info(np.int32(3)).step == 3


def test_failed_constructor_leaves_no_signal_handler(tmp_path: Path) -> None:
    code = (
        "import os, signal, ckptmgr\n"
        "try:\n"
        f"    ckptmgr.CheckpointManager({str(tmp_path / 'run')!r}, 1, process_group=object())\n"
        "except ckptmgr.ConfigError:\n"
        "    pass\n"
        "assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('survived')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -signal.SIGTERM, (out.returncode, out.stdout, out.stderr)
    assert "survived" not in out.stdout
    assert not (tmp_path / "run").exists()  # and no lease, nothing written


def _root_untouched(root: Path, **kwargs: Any) -> pytest.ExceptionInfo[ConfigError]:
    with pytest.raises(ConfigError) as info:
        CheckpointManager(str(root), save_interval=1, **kwargs)
    assert not root.exists()  # failed before any I/O that changes storage
    return info


def test_bad_preemption_check_and_local_path_fail_before_the_root_is_made(
        tmp_path: Path) -> None:
    """Found by review (also before this round): these failed only after the root directory
    was created, and a local_path under a file escaped as a raw NotADirectoryError."""
    root = tmp_path / "run"
    info = _root_untouched(root, preemption_check=5)
    assert "preemption_check must be callable" in str(info.value)
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"x")
    for bad in (a_file, a_file / "below"):
        info = _root_untouched(root, local_path=str(bad), local_interval=1)
        assert "local_path" in str(info.value) and "not a directory" in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_local_path_that_cannot_be_created_fails_before_the_root_is_made(
        tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    info = _root_untouched(tmp_path / "run", local_path=str(locked / "local"), local_interval=1)
    assert "cannot be created" in str(info.value)


def test_signals_off_the_main_thread_fail_before_the_root_is_made(tmp_path: Path) -> None:
    import threading

    out: list[BaseException] = []
    root = tmp_path / "run"

    def construct() -> None:
        try:
            CheckpointManager(str(root), save_interval=1)
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=construct)
    t.start()
    t.join()
    assert len(out) == 1 and isinstance(out[0], ConfigError), out
    assert "main thread" in str(out[0])
    assert not root.exists()
