"""Never lose a run, part II (issue 15): data ckptmgr did not write, retention around the step a
save committed, two processes on one root, a reader beside an overwriting writer, and the fsync
before an overwrite's manifest.

Processes are real (:class:`_holder.Holder`) and ordered by blocking calls and file gates.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _faulty import wrap
from _holder import Holder, restored_version, state, wait_for_file

import ckptmgr.manager
from ckptmgr import CheckpointExistsError, CheckpointManager
from ckptmgr.codec.layout import MANIFEST_NAME
from ckptmgr.errors import CorruptCheckpointError, LeaseError, RestoreError
from ckptmgr.storage import Storage


def _fs(root: str) -> tuple[Any, str]:
    fs, path = fsspec.core.url_to_fs(root)
    return fs, path.rstrip("/")


def _put(root: str, rel: str, data: bytes) -> None:
    fs, path = _fs(root)
    fs.makedirs(os.path.dirname(f"{path}/{rel}"), exist_ok=True)
    fs.pipe_file(f"{path}/{rel}", data)


def _files(root: str, rel: str) -> dict[str, bytes]:
    """The files under ``root/rel`` (relative name -> content); {} if absent."""
    fs, path = _fs(root)
    base = f"{path}/{rel}"
    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache()
    if not fs.exists(base):
        return {}
    return {p[len(base) + 1:]: fs.cat_file(p) for p in fs.find(base)}


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


# ------------------------------------------------------------------------- foreign files


def test_foreign_file_in_a_step_dir_survives_every_save(root: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    _put(root, "6/my-notes.txt", b"do not delete")
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
        assert _files(root, "6") == {"my-notes.txt": b"do not delete"}
        assert mgr.save(7, state(7)) is True
        assert mgr.save(8, state(8)) is True  # retention and leftover cleanup run here
        assert mgr.all_steps() == [8]
    assert _files(root, "6") == {"my-notes.txt": b"do not delete"}


def test_foreign_dcp_step_is_listed_never_counted_deleted_or_written(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path / "run")
    _dcp_save(os.path.join(root, "5"))
    before = _files(root, "5")
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
    assert _files(root, "5") == before
    with CheckpointManager(root, save_interval=1, read_only=True) as reader:
        assert reader.all_steps() == [5, 7, 8]
        assert reader.step_info(5).format == "dcp"


def test_retention_deletes_our_files_and_keeps_a_foreign_one(root: str) -> None:
    with CheckpointManager(root, save_interval=1, max_to_keep=1) as mgr:
        assert mgr.save(1, state(1)) is True
        _put(root, "1/notes.txt", b"mine")
        assert set(_files(root, "1")) > {MANIFEST_NAME, "notes.txt"}
        assert mgr.save(2, state(2)) is True  # retention deletes step 1: our files only
        assert mgr.all_steps() == [2]
        assert _files(root, "1") == {"notes.txt": b"mine"}
        assert mgr.save(3, state(3)) is True  # leftover cleanup does not take it either
        assert mgr.save(1, state(1)) is False  # a due save of that directory: skipped
    assert _files(root, "1") == {"notes.txt": b"mine"}
    with CheckpointManager(root, save_interval=1, overwrite=True) as mgr:
        assert mgr.all_steps() == [3]
        _put(root, "3/notes.txt", b"also mine")  # foreign file in a committed step of ours
        with pytest.raises(CheckpointExistsError, match=r"notes\.txt"):
            mgr.save(3, state(30), force=True)
        assert restored_version(mgr, 3) == 3


# ------------------------------------------------------------------------------ retention


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


# ---------------------------------------------------------------------- two processes


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


def test_reader_during_overwrites_gets_old_or_new_never_corrupt(local_root: str,
                                                                tmp_path: Any) -> None:
    a = Holder(local_root, overwrite=True)
    try:
        assert a.ok("save", 5, 1) is True
        stop = str(tmp_path / "stop")
        with CheckpointManager(local_root, save_interval=1, read_only=True) as reader:
            a.send("save_loop", 5, stop)
            wait_for_file(stop + ".started")  # step 5 has been overwritten at least once
            seen: list[int] = []
            retryable = 0
            for _ in range(30):
                try:
                    seen.append(restored_version(reader, 5))
                except RestoreError as e:
                    # Honest and retryable, never "damaged": overwritten on every one of the
                    # reader's tries (the writer is in a tight loop, the machine may be loaded).
                    assert not isinstance(e, CorruptCheckpointError), e
                    assert "was overwritten" in str(e) and "not damaged" in str(e), e
                    retryable += 1
            open(stop, "w").close()
            status, saves = a.answer()
            assert status == "ok", saves
        assert saves >= 2
        assert seen == sorted(seen) and seen[-1] <= saves + 1, seen  # never older than before
        assert len(set(seen)) > 1, seen  # the restores did overlap overwrites
        assert retryable < len(seen), (retryable, seen)
    finally:
        a.stop()


# --------------------------------------------------------------------------- durability


def test_overwrite_fsyncs_the_step_dir_before_the_manifest(
        local_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    real_open = ckptmgr.manager.open_storage

    def open_storage(*args: Any, **kwargs: Any) -> Storage:
        st: Any = wrap(real_open(*args, **kwargs))
        fsync_dir, write_bytes = st.fsync_dir, st.write_bytes

        def record_fsync(path: str) -> None:
            calls.append(("fsync_dir", path))
            fsync_dir(path)

        def record_write(path: str, data: bytes, *, exclusive: bool = False) -> None:
            calls.append(("write_bytes", path))
            write_bytes(path, data, exclusive=exclusive)

        st.fsync_dir, st.write_bytes = record_fsync, record_write
        return st  # type: ignore[no-any-return]

    monkeypatch.setattr(ckptmgr.manager, "open_storage", open_storage)
    with CheckpointManager(local_root, save_interval=1, overwrite=True) as mgr:
        mgr.save(3, state(1))
        calls.clear()
        assert mgr.save(3, state(2)) is True
        assert restored_version(mgr, 3) == 2
    manifest = calls.index(("write_bytes", f"3/{MANIFEST_NAME}"))
    assert ("fsync_dir", "3") in calls[:manifest], calls


@pytest.mark.parametrize("when", ["before-metadata", "before-data"])
def test_restore_of_a_step_overwritten_midway_reads_the_new_version(
        local_root: str, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """Deterministic form of the race above: the writer overwrites step 5 (dropping the old
    attempt's files) exactly between the reader's manifest read and its metadata read, or its
    data reads. The reader must get the new version, not CorruptCheckpointError/StorageError."""
    real_open = ckptmgr.manager.open_storage
    with CheckpointManager(local_root, save_interval=1, overwrite=True) as writer:
        writer.save(5, state(1))
        fired: list[str] = []

        def open_storage(*args: Any, **kwargs: Any) -> Storage:
            st: Any = real_open(*args, **kwargs)
            marker = "/metadata-" if when == "before-metadata" else "/data-"
            for name in ("size", "open_reader", "read_into"):
                real = getattr(st, name, None)
                if real is None:
                    continue

                def hooked(path: str, *rest: Any, real: Any = real) -> Any:
                    if marker in path and not fired:
                        fired.append(path)
                        assert writer.save(5, state(2), force=True) is True
                    return real(path, *rest)

                setattr(st, name, hooked)
            return st  # type: ignore[no-any-return]

        monkeypatch.setattr(ckptmgr.manager, "open_storage", open_storage)
        with CheckpointManager(local_root, save_interval=1, read_only=True) as reader:
            assert restored_version(reader, 5) == 2
        assert fired, "the overwrite never ran inside the restore"


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
