"""ckptmgr/step_store.py on real files (a local root in a temporary directory): commit, listing,
the fenced removal door, leftovers of crashed saves and read verification."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptmgr
from ckptmgr.codec.checksum import checksum
from ckptmgr.codec.manifest import FileEntry, Manifest
from ckptmgr.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LeaseError,
    UnsafeCheckpointError,
)
from ckptmgr.step_store import CommitPlan, StepStore
from ckptmgr.storage import open_storage

MAX = 1 << 20


def _store(root: Path, calls: list[str] | None = None) -> StepStore:
    """A writer's store on ``root`` whose fence records each check in ``calls``."""
    def fence() -> None:
        if calls is not None:
            calls.append("fence")

    return StepStore(open_storage(str(root)), fence=fence)


def _files(attempt: str, payload: bytes = b"tensor bytes") -> dict[str, bytes]:
    return {f"data-{attempt}-r00000-000.bin": payload, f"metadata-{attempt}.json": b"{}"}


def _manifest(plan: CommitPlan, files: dict[str, bytes]) -> Manifest:
    entries = tuple(FileEntry(n, len(b), checksum(b)) for n, b in sorted(files.items()))
    return Manifest(step=plan.step, time="2026-11-26T05:00:00.000000Z", attempt=plan.attempt,
                    world_size=1, metadata_file=f"metadata-{plan.attempt}.json", files=entries,
                    bytes_per_rank={0: sum(len(b) for b in files.values())}, versions={})


def _save(store: StepStore, step: int, *, payload: bytes = b"tensor bytes",
          overwrite: bool = False) -> CommitPlan:
    """One whole save of ``step`` through the store, as the coordinator runs it."""
    plan = store.begin_save(step, forced=True, overwrite=overwrite, world_size=1)
    assert plan is not None
    files = _files(plan.attempt, payload)
    for name, data in files.items():
        store.storage.write_bytes(f"{plan.write_dir}/{name}", data)
    store.commit(plan, _manifest(plan, files))
    if not plan.staged:
        store.remove_replaced_attempts(plan)
    return plan


def _crashed(store: StepStore, step: int) -> CommitPlan:
    """A save of ``step`` that wrote its data and died before the commit."""
    plan = store.begin_save(step, forced=True, overwrite=False, world_size=1)
    assert plan is not None
    for name, data in _files(plan.attempt).items():
        store.storage.write_bytes(f"{plan.write_dir}/{name}", data)
    return plan


# ---------------------------------------------------------------------------------- commit


def test_a_staged_commit_renames_into_place_and_lists(tmp_path: Path) -> None:
    calls: list[str] = []
    store = _store(tmp_path, calls)
    plan = store.begin_save(5, forced=True, overwrite=False, world_size=1)
    assert plan is not None and plan.staged and plan.step_dir == "5"
    assert plan.write_dir.startswith(".tmp-5-") and plan.attempt in plan.write_dir
    assert store.committed_steps() == []  # nothing visible before the commit
    files = _files(plan.attempt)
    for name, data in files.items():
        store.storage.write_bytes(f"{plan.write_dir}/{name}", data)
    store.commit(plan, _manifest(plan, files))
    assert calls == ["fence"]  # checked right before the step became visible
    assert store.committed_steps() == [5]
    assert sorted(os.listdir(tmp_path)) == ["5"]  # the staging directory is the step now
    manifest, raw = store.read_manifest_bytes(5)
    assert manifest.attempt == plan.attempt and raw == (tmp_path / "5" / "commit.json").read_bytes()


def test_a_commit_whose_fence_fails_makes_nothing_visible(tmp_path: Path) -> None:
    def lost() -> None:
        raise LeaseError("lost the lease")

    store = StepStore(open_storage(str(tmp_path)), fence=lost)
    plan = store.begin_save(5, forced=True, overwrite=False, world_size=1)
    assert plan is not None
    files = _files(plan.attempt)
    for name, data in files.items():
        store.storage.write_bytes(f"{plan.write_dir}/{name}", data)
    with pytest.raises(LeaseError, match="lost"):
        store.commit(plan, _manifest(plan, files))
    assert store.committed_steps() == [] and not (tmp_path / "5").exists()


def test_an_overwrite_commits_in_place_and_removes_the_replaced_attempt(tmp_path: Path) -> None:
    store = _store(tmp_path)
    first = _save(store, 5, payload=b"old")
    second = _save(store, 5, payload=b"new!", overwrite=True)
    assert not second.staged and second.overwrite and second.write_dir == "5"
    assert store.read_manifest(5).attempt == second.attempt
    names = sorted(os.listdir(tmp_path / "5"))
    assert names == sorted(["commit.json", *_files(second.attempt)]), names
    assert not any(first.attempt in n for n in names)


def test_an_existing_step_is_skipped_when_due_and_refused_when_forced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = _store(tmp_path)
    _save(store, 5)
    with caplog.at_level(logging.WARNING, logger="ckptmgr"):
        assert store.begin_save(5, forced=False, overwrite=False, world_size=1) is None
    assert "already committed" in caplog.text
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        store.begin_save(5, forced=True, overwrite=False, world_size=1)
    # "skip": a preemption save never fails on an existing step
    assert store.begin_save(5, forced=True, overwrite=False, world_size=1,
                            on_exists="skip") is None


def test_a_foreign_directory_is_never_written_into(tmp_path: Path) -> None:
    store = _store(tmp_path)
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="did not write"):
        store.begin_save(7, forced=True, overwrite=True, world_size=1)
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / ".metadata").write_bytes(b"dcp")
    with pytest.raises(CheckpointExistsError, match="plain-DCP"):
        store.begin_save(8, forced=True, overwrite=True, world_size=1)
    assert sorted(os.listdir(tmp_path / "7")) == ["notes.txt"]
    assert sorted(os.listdir(tmp_path / "8")) == [".metadata"]


def test_a_symlinked_step_is_never_written_nor_read(tmp_path: Path) -> None:
    store = _store(tmp_path / "root")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "root").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "root" / "4")
    with pytest.raises(CheckpointExistsError, match="symbolic link"):
        store.begin_save(4, forced=True, overwrite=True, world_size=1)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        store.read_manifest(4)
    assert store.scan().symlinks == ["4"] and os.listdir(tmp_path / "elsewhere") == []


# --------------------------------------------------------------------------------- listing


def test_scan_classifies_every_kind_of_entry(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _save(store, 10)
    _save(store, 2)
    crashed = _crashed(store, 30)  # staged: a .tmp-30-<attempt> directory
    (tmp_path / "40").mkdir()  # our leftover written in place (an object store's way)
    (tmp_path / "40" / "data-0123456789ab-r00000-000.bin").write_bytes(b"x")
    (tmp_path / "50").mkdir()
    (tmp_path / "50" / ".metadata").write_bytes(b"dcp")
    (tmp_path / "60").mkdir()
    (tmp_path / "60" / "train.csv").write_text("a,b")
    (tmp_path / "notes").mkdir()  # not a step name: not listed at all
    (tmp_path / "007").mkdir()  # nor is a step number spelled otherwise
    scan = store.scan()
    assert scan.committed == [2, 10]
    assert scan.dcp_steps == [50]
    assert scan.uncommitted == ["40", "60"]
    assert scan.staging == [crashed.write_dir]
    assert store.is_ours("40") and not store.is_ours("60")
    assert store.foreign_files("60") == ["train.csv"]


def test_resolve_and_not_found_name_what_exists(tmp_path: Path) -> None:
    store = _store(tmp_path)
    for step in (1, 2, 3):
        _save(store, step)
    assert store.resolve(None) == 3 and store.resolve(2) == 2
    (tmp_path / "9").mkdir()
    with pytest.raises(IncompleteCheckpointError, match=r"never committed.*\[1, 2, 3\]"):
        store.resolve(9)
    with pytest.raises(CheckpointNotFoundError, match=r"available steps: \[1, 2, 3\]"):
        store.resolve(4)
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        _store(tmp_path / "empty").resolve(None)


# ----------------------------------------------------------------------------- the door


def test_a_reader_removes_nothing(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    storage.makedirs("7")
    storage.write_bytes("7/data-0123456789ab-r00000-000.bin", b"x")
    with pytest.raises(LeaseError, match="removes nothing"):
        StepStore(storage).remove_leftover("7")
    assert storage.exists("7/data-0123456789ab-r00000-000.bin")


def test_the_fence_runs_before_every_removal_and_stops_it(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    storage.makedirs("7")
    storage.write_bytes("7/data-0123456789ab-r00000-000.bin", b"x")
    calls: list[str] = []

    def fence() -> None:
        calls.append("checked")
        raise LeaseError("lost")

    with pytest.raises(LeaseError, match="lost"):
        StepStore(storage, fence=fence).remove_leftover("7")
    assert calls == ["checked"] and storage.exists("7/data-0123456789ab-r00000-000.bin")


def test_delete_step_removes_the_manifest_first_and_keeps_foreign_files(
        tmp_path: Path) -> None:
    calls: list[str] = []
    store = _store(tmp_path, calls)
    _save(store, 3)
    _save(store, 4)
    (tmp_path / "4" / "notes.txt").write_text("the user's")
    calls.clear()
    real_remove = store.storage.remove
    removed: list[str] = []

    def remove(path: str, *, recursive: bool = False) -> None:
        removed.append(path)
        real_remove(path, recursive=recursive)

    store.storage.remove = remove  # type: ignore[method-assign]
    store.delete_step(3)
    assert removed == ["3/commit.json", "3"] and len(calls) == 2  # the fence before each
    store.delete_step(4)
    assert removed[2] == "4/commit.json"
    assert store.committed_steps() == []
    assert os.listdir(tmp_path / "4") == ["notes.txt"]  # only ckptmgr's files went


def test_a_delete_whose_fence_fails_keeps_the_step_committed(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _save(store, 3)

    def taken_over() -> None:
        raise LeaseError("taken over")

    store.fence = taken_over
    with pytest.raises(LeaseError, match="taken over"):
        store.delete_step(3)
    assert store.committed_steps() == [3]


# ------------------------------------------------------------------------------- leftovers


def test_remove_leftovers_removes_only_provably_ours(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _save(store, 1)
    crashed = _crashed(store, 2)
    kept = _crashed(store, 3)
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / "data-0123456789ab-r00000-000.bin").write_bytes(b"x")
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "data-0123456789ab-r00000-000.bin").write_bytes(b"x")
    (tmp_path / "5" / "train.csv").write_text("not ours")
    (tmp_path / "6").mkdir()
    (tmp_path / "6" / "data-0123456789ab-r00000-000.bin").write_bytes(b"x")
    removed = store.remove_leftovers(store.scan(), keep_attempt=kept.attempt, protect=[6])
    assert sorted(removed) == sorted([crashed.write_dir, "4"])
    assert sorted(os.listdir(tmp_path)) == sorted(["1", kept.write_dir, "5", "6"])


def test_remove_leftover_dry_run_says_without_removing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / "data-0123456789ab-r00000-000.bin").write_bytes(b"x")
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "train.csv").write_text("not ours")
    assert store.remove_leftover("4", dry_run=True) and (tmp_path / "4").exists()
    assert not store.remove_leftover("5") and (tmp_path / "5" / "train.csv").exists()
    assert store.remove_leftover("4") and not (tmp_path / "4").exists()


def test_a_leftover_of_the_same_step_is_removed_before_a_staged_save(tmp_path: Path) -> None:
    store = _store(tmp_path)
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / "data-0123456789ab-r00000-000.bin").write_bytes(b"x")
    plan = _save(store, 4)
    assert sorted(os.listdir(tmp_path / "4")) == sorted(["commit.json", *_files(plan.attempt)])


def test_discard_removes_a_failed_attempt_and_never_a_committed_one(tmp_path: Path) -> None:
    store = _store(tmp_path)
    committed = _save(store, 1)
    failed = _crashed(store, 2)
    store.discard(failed)
    assert not (tmp_path / failed.write_dir).exists()
    store.discard(committed)  # it committed after all (a staged plan's directory was renamed)
    assert store.committed_steps() == [1]
    overwrite = store.begin_save(1, forced=True, overwrite=True, world_size=1)
    assert overwrite is not None and not overwrite.staged
    for name, data in _files(overwrite.attempt).items():
        store.storage.write_bytes(f"1/{name}", data)
    store.discard(overwrite)  # in place: only the failed attempt's files go
    assert store.read_manifest(1).attempt == committed.attempt
    assert not any(overwrite.attempt in n for n in os.listdir(tmp_path / "1"))
    assert sorted(os.listdir(tmp_path / "1")) == sorted(["commit.json",
                                                         *_files(committed.attempt)])


# ------------------------------------------------------------------------ read verification


def _data_name(plan: CommitPlan) -> str:
    return f"data-{plan.attempt}-r00000-000.bin"


def test_read_file_checks_the_checksum_unless_told_not_to(tmp_path: Path) -> None:
    store = _store(tmp_path)
    plan = _save(store, 1, payload=b"0123456789")
    manifest = store.read_manifest(1)
    name = _data_name(plan)
    assert store.read_file(1, manifest, name, max_bytes=MAX) == b"0123456789"
    (tmp_path / "1" / name).write_bytes(b"0123456780")  # one byte flipped, same size
    with pytest.raises(CorruptCheckpointError, match=name) as ei:
        store.read_file(1, manifest, name, max_bytes=MAX)
    assert ei.value.path == name and ei.value.step == 1
    assert store.read_file(1, manifest, name, max_bytes=MAX, verify=False) == b"0123456780"


def test_read_file_checks_the_size_before_reading(tmp_path: Path) -> None:
    store = _store(tmp_path)
    plan = _save(store, 1, payload=b"0123456789")
    manifest = store.read_manifest(1)
    name = _data_name(plan)
    with pytest.raises(CorruptCheckpointError, match="limit 4"):
        store.read_file(1, manifest, name, max_bytes=4)
    (tmp_path / "1" / name).write_bytes(b"0123456789" * 1000)
    read: list[str] = []
    real_read = store.storage.read_bytes

    def read_bytes(path: str, *args: Any, **kwargs: Any) -> bytes:
        read.append(path)
        return real_read(path, *args, **kwargs)

    store.storage.read_bytes = read_bytes  # type: ignore[method-assign]
    with pytest.raises(CorruptCheckpointError, match="the manifest says 10"):
        store.read_file(1, manifest, name, max_bytes=MAX, verify=False)
    assert read == []  # refused on its size, never read
    (tmp_path / "1" / name).unlink()
    with pytest.raises(CorruptCheckpointError, match="file is missing"):
        store.read_file(1, manifest, name, max_bytes=MAX)


def test_read_file_refuses_a_symlink(tmp_path: Path) -> None:
    store = _store(tmp_path / "root")
    plan = _save(store, 1)
    manifest = store.read_manifest(1)
    name = _data_name(plan)
    target = tmp_path / "outside.bin"
    target.write_bytes((tmp_path / "root" / "1" / name).read_bytes())
    (tmp_path / "root" / "1" / name).unlink()
    os.symlink(target, tmp_path / "root" / "1" / name)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        store.read_file(1, manifest, name, max_bytes=MAX)


def test_a_damaged_or_oversized_manifest_is_corrupt(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _save(store, 1)
    _save(store, 2)
    (tmp_path / "1" / "commit.json").write_bytes(b"{not json")
    with pytest.raises(CorruptCheckpointError, match=r"step 1: commit\.json"):
        store.read_manifest(1)
    with open(tmp_path / "2" / "commit.json", "ab") as f:
        f.truncate(64 << 20)  # sparse: over the manifest limit without writing it
    with pytest.raises(CorruptCheckpointError, match="over the"):
        store.read_manifest(2)
    records = store.records([1, 2], read_manifests=True)  # retention still sees both
    assert sorted(records) == [1, 2] and all(r.time != r.time for r in records.values())


# ------------------------------------------------------------------- through the manager


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((64,), float(v)), "extra": {"v": v}}


def test_fenced_writer_after_commit_removes_nothing_of_the_new_holder(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Between writer A's commit and its clean-up, writer B takes the root over and starts a
    save: A's clean-up (leftovers, retention) must not delete B's in-flight step."""
    root = f"memory://trust-{os.getpid()}-{time.monotonic_ns()}"
    a = ckptmgr.CheckpointManager(root, save_interval=1, max_to_keep=1)
    assert a.save(1, _state(1))
    holder: dict[str, Any] = {}
    real_scan = StepStore.scan

    def scan_after_takeover(self: StepStore) -> Any:
        if self is a._durable.store and "b" not in holder:  # A's clean-up after committing step 2
            b = ckptmgr.CheckpointManager(root, save_interval=1, take_over=True)
            plan = b._durable.store.begin_save(3, forced=True, overwrite=False, world_size=1)
            assert plan is not None
            b._durable.store.storage.write_bytes(
                f"{plan.write_dir}/data-{plan.attempt}-r00000-000.bin", b"in flight")
            holder.update(b=b, plan=plan)
        return real_scan(self)

    monkeypatch.setattr(StepStore, "scan", scan_after_takeover)
    a.save(2, _state(2))  # commits (the lease was A's), then finds itself fenced
    monkeypatch.setattr(StepStore, "scan", real_scan)
    b, plan = holder["b"], holder["plan"]
    files = b._durable.store.storage.list_files(plan.write_dir)
    assert files == {f"data-{plan.attempt}-r00000-000.bin": 9}, "A deleted B's in-flight step"
    with pytest.raises(ckptmgr.errors.LeaseError):
        a.save(4, _state(4))
    b.close()
    a.close()
