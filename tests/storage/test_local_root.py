"""Local roots and URLs checked at construction: a NUL byte in a path, credentials in a file URL
(refused without echo), a read-only or chmod 0555 root; a root made read-only afterwards fails the
save with a SaveError."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptmgr import CheckpointManager


def test_nul_byte_in_local_path_is_config_error(tmp_path: Path) -> None:
    from ckptmgr import ConfigError

    for url in (f"{tmp_path}/a\x00b", f"file://{tmp_path}/a\x00b"):
        with pytest.raises(ConfigError, match="NUL byte"):
            CheckpointManager(url, save_interval=1, chkpt_on_preemption=False)


def test_credentials_in_file_url_are_refused_without_echo(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptmgr import ConfigError

    monkeypatch.chdir(tmp_path)
    for url in (f"file://alice:hunter2-secret@{tmp_path}/run", "file://alice:hunter2-secret@/x"):
        with pytest.raises(ConfigError, match="cannot carry credentials") as info:
            CheckpointManager(url, save_interval=1, chkpt_on_preemption=False)
        assert "hunter2-secret" not in str(info.value) and "alice" not in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no directory named after the password


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs of our own, so that it can be remounted read-only (needs CAP_SYS_ADMIN)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "none", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root or no CAP_SYS_ADMIN)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _remount(mnt: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], check=True)


def test_read_only_root_fails_in_constructor_with_path_and_reason(tmpfs: Path) -> None:
    from ckptmgr import ConfigError

    (tmpfs / "existing").mkdir()
    _remount(tmpfs, "ro")
    for root in (tmpfs / "existing", tmpfs / "new" / "run"):
        with pytest.raises(ConfigError, match="read-only file system") as info:
            CheckpointManager(str(root), save_interval=1, chkpt_on_preemption=False)
        assert str(root) in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_chmod_0555_root_fails_in_constructor(tmp_path: Path) -> None:
    from ckptmgr import ConfigError

    root = tmp_path / "run"
    root.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match="permission denied"):
        CheckpointManager(str(root), save_interval=1, chkpt_on_preemption=False)


def test_root_read_only_after_construction_save_is_save_error(tmpfs: Path) -> None:
    from ckptmgr import SaveError

    mgr = CheckpointManager(str(tmpfs / "run"), save_interval=1, chkpt_on_preemption=False)
    try:
        assert mgr.save(1, {"w": torch.ones(3)})
        _remount(tmpfs, "ro")
        with pytest.raises(SaveError, match="Read-only file system"):
            mgr.save(2, {"w": torch.ones(3)})
        assert mgr.all_steps() == [1]
    finally:
        _remount(tmpfs, "rw")
        mgr.close()
