"""One writer per root: a second process, or a second manager in one process, is refused.

Processes are real (:class:`_procs.Holder`) and ordered by blocking calls and file gates."""

from __future__ import annotations

import pytest
from _model import snapshot
from _procs import Holder, restored_version, state

from ckptmgr import CheckpointManager
from ckptmgr.errors import LeaseError


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
        assert snapshot(f"{root}/2") != {}
