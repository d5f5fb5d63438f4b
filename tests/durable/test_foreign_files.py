"""Data ckptmgr did not write, in a root: a foreign file in a step directory, a plain DCP step, user
subdirectories and look-alike names are listed as they are and never deleted or counted as ours."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _model import put, snapshot
from _procs import restored_version, state

from ckptmgr import CheckpointExistsError, CheckpointManager
from ckptmgr.codec.layout import MANIFEST_NAME


def _skips(caplog: pytest.LogCaptureFixture, step: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and f"skipping the save of step {step}" in
            r.getMessage()]


def _dcp_save(path: str) -> None:
    """A plain-DCP checkpoint (what torch_xla's manager or torchtitan write) at ``path``."""
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process: that is what this fixture is.
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"a": torch.arange(6.0)}, checkpoint_id=path, no_dist=True)


def test_foreign_file_in_a_step_dir_survives_every_save(root: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    put(root, "6/my-notes.txt", b"do not delete")
    caplog.set_level(logging.WARNING, logger="ckptmgr")
    with CheckpointManager(root, save_interval=1, max_to_keep=1, overwrite=True) as mgr:
        assert mgr.all_steps() == []
        assert mgr.save(6, state(6)) is False  # due: skipped, one warning
        assert len(_skips(caplog, 6)) == 1 and "my-notes.txt" in _skips(caplog, 6)[0]
        assert mgr.save_async(6, state(6)) is False
        for call in (mgr.save, mgr.save_async):  # forced: refused, even with overwrite=True
            with pytest.raises(CheckpointExistsError, match=r"my-notes\.txt") as ei:
                call(6, state(6), force=True)
            assert "did not write" in str(ei.value)
        mgr.join()
        assert snapshot(f"{root}/6") == {"my-notes.txt": b"do not delete"}
        assert mgr.save(7, state(7)) is True
        assert mgr.save(8, state(8)) is True  # retention and leftover cleanup run here
        assert mgr.all_steps() == [8]
    assert snapshot(f"{root}/6") == {"my-notes.txt": b"do not delete"}


def test_foreign_dcp_step_is_listed_never_counted_deleted_or_written(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path / "run")
    _dcp_save(os.path.join(root, "5"))
    before = snapshot(f"{root}/5")
    assert {".metadata", "__0_0.distcp"} <= set(before)
    caplog.set_level(logging.WARNING, logger="ckptmgr")
    with CheckpointManager(root, save_interval=1, max_to_keep=2, overwrite=True) as mgr:
        assert mgr.all_steps() == [5]
        assert mgr.step_info(5).format == "dcp"
        assert mgr.save(5, state(5)) is False
        assert len(_skips(caplog, 5)) == 1 and "plain-DCP" in _skips(caplog, 5)[0]
        with pytest.raises(CheckpointExistsError, match="plain-DCP"):
            mgr.save(5, state(5), force=True)
        for s in (6, 7, 8):
            assert mgr.save(s, state(s)) is True
        # max_to_keep=2 counts only our committed steps: 7 and 8; step 5 is not ours to delete.
        assert mgr.all_steps() == [5, 7, 8]
    assert snapshot(f"{root}/5") == before
    with CheckpointManager(root, save_interval=1, read_only=True) as reader:
        assert reader.all_steps() == [5, 7, 8]
        assert reader.step_info(5).format == "dcp"


def test_retention_deletes_our_files_and_keeps_a_foreign_one(root: str) -> None:
    with CheckpointManager(root, save_interval=1, max_to_keep=1) as mgr:
        assert mgr.save(1, state(1)) is True
        put(root, "1/notes.txt", b"mine")
        assert set(snapshot(f"{root}/1")) > {MANIFEST_NAME, "notes.txt"}
        assert mgr.save(2, state(2)) is True  # retention deletes step 1: our files only
        assert mgr.all_steps() == [2]
        assert snapshot(f"{root}/1") == {"notes.txt": b"mine"}
        assert mgr.save(3, state(3)) is True  # leftover cleanup does not take it either
        assert mgr.save(1, state(1)) is False  # a due save of that directory: skipped
    assert snapshot(f"{root}/1") == {"notes.txt": b"mine"}
    with CheckpointManager(root, save_interval=1, overwrite=True) as mgr:
        assert mgr.all_steps() == [3]
        put(root, "3/notes.txt", b"also mine")  # foreign file in a committed step of ours
        with pytest.raises(CheckpointExistsError, match=r"notes\.txt"):
            mgr.save(3, state(30), force=True)
        assert restored_version(mgr, 3) == 3


def test_user_subdirectories_and_lookalike_names_are_never_leftovers(local_root: str) -> None:
    # A directory holding only sub-directories (an Orbax-style "7/default/array"), and files whose
    # names merely start like ours ("data-train.csv"), are not leftovers of a crashed save.
    planted = ["6/notes/todo.txt", "7/default/array", "8/data-train.csv",
               "8/metadata-notes.yaml"]
    for rel in planted:
        path = os.path.join(local_root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("mine")
    with CheckpointManager(local_root, save_interval=1, max_to_keep=1) as mgr:
        assert mgr.save(1, state(1)) is True
        assert mgr.save(6, state(6)) is False  # due: skipped, the directory is not ours
        with pytest.raises(CheckpointExistsError, match="notes/"):
            mgr.save(6, state(6), force=True)
        assert mgr.save(9, state(9)) is True
    for rel in planted:
        assert os.path.isfile(os.path.join(local_root, rel)), rel


def test_retention_keeps_a_user_subdirectory_inside_a_committed_step(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=1, max_to_keep=1) as mgr:
        mgr.save(1, state(1))
        os.makedirs(os.path.join(local_root, "1", "extra"))
        with open(os.path.join(local_root, "1", "extra", "keep.txt"), "w") as f:
            f.write("mine")
        mgr.save(2, state(2))
        assert mgr.all_steps() == [2]
    assert os.path.isfile(os.path.join(local_root, "1", "extra", "keep.txt"))
    assert not [n for n in os.listdir(os.path.join(local_root, "1")) if n.startswith("data-")]
