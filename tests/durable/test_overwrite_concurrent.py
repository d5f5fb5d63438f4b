"""A reader beside an overwriting writer gets the old or the new version, never a damaged one; the
step directory is fsynced before an overwrite's manifest.

Processes are real (:class:`_procs.Holder`) and ordered by blocking calls and file gates."""

from __future__ import annotations

from typing import Any

import pytest
from _faulty import wrap
from _procs import Holder, restored_version, state, wait_for_file

import ckptmgr.durable
from ckptmgr import CheckpointManager
from ckptmgr.codec.layout import MANIFEST_NAME
from ckptmgr.errors import CorruptCheckpointError, RestoreError
from ckptmgr.storage import Storage


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


def test_overwrite_fsyncs_the_step_dir_before_the_manifest(
        local_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str]] = []
    real_open = ckptmgr.durable.open_storage

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

    monkeypatch.setattr(ckptmgr.durable, "open_storage", open_storage)
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
    real_open = ckptmgr.durable.open_storage
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

        monkeypatch.setattr(ckptmgr.durable, "open_storage", open_storage)
        with CheckpointManager(local_root, save_interval=1, read_only=True) as reader:
            assert restored_version(reader, 5) == 2
        assert fired, "the overwrite never ran inside the restore"
