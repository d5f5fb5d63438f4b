"""One writer per root: a second process, or a second manager in one process, is refused.

Processes are real (:class:`_procs.Holder`) and ordered by blocking calls and file gates."""

from __future__ import annotations

from typing import Any

import fsspec
import pytest
from _procs import Holder, restored_version, state

from ckptmgr import CheckpointManager
from ckptmgr.errors import LeaseError


def _fs(root: str) -> tuple[Any, str]:
    fs, path = fsspec.core.url_to_fs(root)
    return fs, path.rstrip("/")


def _files(root: str, rel: str) -> dict[str, bytes]:
    """The files under ``root/rel`` (relative name -> content); {} if absent."""
    fs, path = _fs(root)
    base = f"{path}/{rel}"
    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache()
    if not fs.exists(base):
        return {}
    return {p[len(base) + 1:]: fs.cat_file(p) for p in fs.find(base)}


def test_second_process_saving_to_the_root_is_refused(local_root: str) -> None:
    a = Holder(local_root, max_to_keep=3)
    try:
        assert a.status == "ok", a.value
        with pytest.raises(LeaseError, match=f"pid {a.pid}"):
            CheckpointManager(local_root, save_interval=1, max_to_keep=3)
        for s in range(1, 13):
            assert a.ok("save_async", s, s) is True
            with pytest.raises(LeaseError):  # refused at every point of the other's saves
                CheckpointManager(local_root, save_interval=1)
        a.ok("join")
        assert a.ok("all_steps") == [10, 11, 12]
        with CheckpointManager(local_root, save_interval=1, read_only=True) as reader:
            assert reader.all_steps() == [10, 11, 12]
            for s in reader.all_steps():
                assert restored_version(reader, s) == s
    finally:
        a.stop()


def test_second_writer_in_one_process_on_any_storage(root: str) -> None:
    with CheckpointManager(root, save_interval=1) as a:
        assert a.save(1, state(1)) is True
        with pytest.raises(LeaseError, match="close\\(\\) it first"):
            CheckpointManager(root, save_interval=1)
        with CheckpointManager(root, save_interval=1, read_only=True) as reader:
            assert restored_version(reader, 1) == 1
        with CheckpointManager(root, save_interval=1, take_over=True) as b:
            with pytest.raises(LeaseError, match="lost its lease"):
                a.save(2, state(2))
            assert b.save(2, state(20)) is True
        assert _files(root, "2") != {}
