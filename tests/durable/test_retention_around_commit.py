"""Retention around the step a save committed: a step below the newest (a re-save of an older step,
as torch_xla's loop does) is kept."""

from __future__ import annotations

from _procs import restored_version, state

from ckptmgr import CheckpointManager


def test_retention_keeps_the_step_the_save_committed_below_the_newest(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=100, max_to_keep=1) as mgr:
        for s in (100, 200, 300):
            assert mgr.save(s, state(s)) is True
        assert mgr.all_steps() == [300]
        assert mgr.save(250, state(250), force=True) is True
        assert mgr.all_steps() == [250, 300]  # kept by the save that committed it
        assert restored_version(mgr, 250) == 250
    with CheckpointManager(local_root, save_interval=100, max_to_keep=1) as mgr:
        assert mgr.all_steps() == [250, 300]
        # Later saves count it by step number: it falls out of the newest max_to_keep.
        assert mgr.save(400, state(400)) is True
        assert mgr.all_steps() == [400]


def test_torch_xla_style_loop_resaving_an_older_step_keeps_it(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=10, max_to_keep=1) as mgr:
        for s in (10, 20):
            mgr.save(s, state(s))
        assert mgr.all_steps() == [20]
    # The loop restarts from 0 (no restore): it saves 10 again, which retention had deleted.
    with CheckpointManager(local_root, save_interval=10, max_to_keep=1) as mgr:
        assert mgr.save(10, state(11)) is True
        assert mgr.all_steps() == [10, 20]
        assert restored_version(mgr, 10) == 11
        assert mgr.save(20, state(21)) is False  # already committed: skipped, not replaced
        assert restored_version(mgr, 20) == 20
        assert mgr.save(30, state(30)) is True
        assert mgr.all_steps() == [30]
