"""A ``local_path`` reused by another run (ckptmgr/local_tier.py, docs/multitier.md "Another run's
local steps"): each local step records the durable root it belongs to; another root's steps are
never listed, restored, uploaded, replicated over, healed over or deleted, and a save of a step
number they hold skips the local tier while the durable tier saves it.

Real files and real gloo ranks (the replica cases, with the peer-replica helpers of
test_replicas.py); run A and run B differ only by their durable root.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import run_ranks
from test_replicas import _held, _Logs, _manager, _resume, _train
from test_replicas import _state as _rank_state

import ckptmgr
from ckptmgr.errors import LeaseError

LAYOUT = "_ckptmgr_local_tier"
UPLOAD = "_ckptmgr_upload"


def _state(run: str, step: int) -> dict[str, Any]:
    """A state whose bytes say which run and step wrote it."""
    g = torch.Generator().manual_seed(step * 31 + (7 if run == "a" else 11))
    return {"w": torch.randn(32, 8, generator=g), "extra": {"run": run, "step": step}}


def _target() -> dict[str, Any]:
    return {"w": torch.zeros(32, 8), "extra": {"run": "", "step": -1}}


def _is(target: dict[str, Any], run: str, step: int) -> bool:
    want = _state(run, step)
    return torch.equal(target["w"], want["w"]) and target["extra"] == want["extra"]


def _mgr(root: Path | str, node: Path, **kw: Any) -> ckptmgr.CheckpointManager:
    kw.setdefault("save_interval", 1000)  # local steps only, unless a test says otherwise
    kw.setdefault("local_max_to_keep", 2)
    return ckptmgr.CheckpointManager(str(root), local_path=str(node), local_interval=5, **kw)


def _files(node: Path) -> dict[str, bytes]:
    """Every file under ``node`` but the writer lease: what a run must leave as it was."""
    return {str(p.relative_to(node)): p.read_bytes() for p in sorted(node.rglob("*"))
            if p.is_file() and p.name != ".ckptmgr-lease.json"}


@pytest.fixture
def warnings_seen() -> Iterator[list[str]]:
    logs = _Logs()
    logging.getLogger("ckptmgr").addHandler(logs)
    yield logs.lines
    logging.getLogger("ckptmgr").removeHandler(logs)


def _run_a(tmp_path: Path, steps: tuple[int, ...] = (5, 10)) -> tuple[Path, Path]:
    a, node = tmp_path / "a", tmp_path / "node"
    with _mgr(a, node) as mgr:
        for s in steps:
            assert mgr.save(s, _state("a", s))
        assert mgr.all_steps() == list(steps[-2:])
    return a, node


# ---------------------------------------------------------------------------- one process


def test_another_roots_steps_are_not_listed_restored_or_deleted(
        tmp_path: Path, warnings_seen: list[str]) -> None:
    a, node = _run_a(tmp_path)
    before = _files(node)
    with _mgr(tmp_path / "b", node, local_max_to_keep=1) as mgr:
        assert mgr.all_steps() == [] and mgr.latest_step() is None
        assert mgr.restore_latest(_target()) is None
        with pytest.raises(ckptmgr.errors.CheckpointNotFoundError):
            mgr.restore(10, _target())
        for s in (15, 20, 25):  # local retention (keep 1) runs after each save
            assert mgr.save(s, _state("b", s))
        assert mgr.all_steps() == [25]
        target = _target()
        assert mgr.restore_latest(target) == 25 and _is(target, "b", 25)
    foreign = [w for w in warnings_seen if "of another durable root" in w]
    assert len(foreign) == 1 and "2 local step(s)" in foreign[0], warnings_seen
    # Run A's files are as it left them; run B's newest step is beside them.
    after = _files(node)
    assert {k: v for k, v in after.items() if k in before} == before
    assert sorted({k.split("/")[1] for k in after if k not in before}) == ["25"]
    # Run A's restart (its root spelled another way) still has them; run B's are foreign.
    with _mgr(f"file://{a}/", node) as mgr:
        assert mgr.all_steps() == [5, 10]
        target = _target()
        assert mgr.restore_latest(target) == 10 and _is(target, "a", 10)


@pytest.mark.parametrize("mode", ["save", "save_async"])
def test_a_step_number_another_root_holds_skips_the_local_tier_only(
        tmp_path: Path, mode: str, warnings_seen: list[str]) -> None:
    # Step 10 is due on both tiers of run B; run A's local step 10 is there: B writes its
    # durable step 10 from its own state (with save_async not from the local files, which
    # are A's), never A's files, and its own local step 15 as usual.
    a, node = _run_a(tmp_path)
    before = _files(node)
    b = tmp_path / "b"
    with _mgr(b, node, save_interval=10) as mgr:
        save = mgr.save if mode == "save" else mgr.save_async
        for s in (10, 15):
            assert save(s, _state("b", s))
        mgr.join()
        assert mgr.all_steps() == [10, 15]
        assert mgr.step_info(10).tiers == ("durable",)
        assert mgr.step_info(15).tiers == ("local",)
    assert any("step 10 is not saved to the local tier" in w for w in warnings_seen)
    after = _files(node)
    assert {k: v for k, v in after.items() if k in before} == before
    with ckptmgr.CheckpointManager(str(b), save_interval=10, read_only=True) as reader:
        target = _target()
        reader.restore(10, target)
        assert _is(target, "b", 10)
    with _mgr(a, node) as mgr:  # run A: its step 10 untouched, nothing of run B's
        assert mgr.all_steps() == [5, 10]
        target = _target()
        mgr.restore(10, target)
        assert _is(target, "a", 10)


def test_a_step_only_the_local_tier_was_due_for_is_saved_by_close(tmp_path: Path) -> None:
    # Run B's step 10 skips the local tier (run A's step 10 is there) and nothing else was due:
    # save() returns False and the step counts as given, not saved, so close() saves it to the
    # durable tier (save_on_close), as for any step given and not saved.
    _, node = _run_a(tmp_path)
    b = tmp_path / "b"
    with _mgr(b, node) as mgr:
        assert mgr.save(10, _state("b", 10)) is False
        assert mgr.all_steps() == []
    with ckptmgr.CheckpointManager(str(b), save_interval=1000, read_only=True) as reader:
        assert reader.all_steps() == [10]
        target = _target()
        reader.restore(10, target)
        assert _is(target, "b", 10)


def test_another_roots_step_removed_by_hand_frees_its_step_number(tmp_path: Path) -> None:
    # The documented remedy while run B is open: remove run A's step; B's next save of that
    # step number goes to the local tier again.
    _, node = _run_a(tmp_path)
    with _mgr(tmp_path / "b", node) as mgr:
        assert mgr.all_steps() == []
        shutil.rmtree(node / "rank-0" / "5")
        assert mgr.save(5, _state("b", 5))
        assert mgr.all_steps() == [5] and mgr.step_info(5).tiers == ("local",)
        assert mgr.save(10, _state("b", 10)) is False  # run A's step 10 is still there
        target = _target()
        assert mgr.restore_latest(target) == 5 and _is(target, "b", 5)


def test_a_step_owed_to_another_root_is_not_uploaded_nor_overwritten(tmp_path: Path) -> None:
    # Run A's step 10 is owed to root A (the job died before its upload). Run B saves step 10
    # in the background (due on both tiers): its durable copy is B's state, and A's restart
    # still uploads A's own step 10 into root A.
    a, b, node = tmp_path / "a", tmp_path / "b", tmp_path / "node"
    with _mgr(a, node, save_interval=10) as mgr:
        assert mgr._uploads is not None
        mgr._uploads.close()  # nothing is uploaded from now on (as if the job died first)
        assert mgr.save_async(10, _state("a", 10))
    with _mgr(b, node, save_interval=10) as mgr:
        assert mgr.all_steps() == []
        assert mgr.save_async(10, _state("b", 10))
        mgr.join()
    for root, run in ((b, "b"), (a, None)):
        with ckptmgr.CheckpointManager(str(root), save_interval=10, read_only=True) as reader:
            assert reader.all_steps() == ([10] if run else [])
            if run:
                target = _target()
                reader.restore(10, target)
                assert _is(target, run, 10)
    with _mgr(a, node, save_interval=10) as mgr:
        mgr.join()
    with ckptmgr.CheckpointManager(str(a), save_interval=10, read_only=True) as reader:
        target = _target()
        reader.restore(10, target)
        assert _is(target, "a", 10)


def _strip_root(node: Path, *, upload_root: str | None = None) -> None:
    """Make every local step look written before roots were recorded (optionally with the upload
    record naming ``upload_root``)."""
    for manifest in node.glob("rank-*/*/commit.json"):
        doc = json.loads(manifest.read_text())
        doc["metadata"][LAYOUT].pop("root", None)
        if upload_root is not None:
            doc["metadata"][UPLOAD] = {"mesh": None, "trusted": False, "root": upload_root}
        manifest.write_text(json.dumps(doc))


def test_steps_written_before_roots_were_recorded(tmp_path: Path,
                                                  warnings_seen: list[str]) -> None:
    # Nothing ties them to another root: this run's, listed and restorable, with one warning.
    a, node = _run_a(tmp_path)
    _strip_root(node)
    with _mgr(a, node) as mgr:
        assert mgr.all_steps() == [5, 10]
        target = _target()
        assert mgr.restore_latest(target) == 10 and _is(target, "a", 10)
    assert sum("did not record their durable root" in w for w in warnings_seen) == 1
    # Their upload record names another root: foreign, left alone by run B.
    _strip_root(node, upload_root=str(a))
    before = _files(node)
    with _mgr(tmp_path / "b", node, local_max_to_keep=1) as mgr:
        assert mgr.all_steps() == []
        assert mgr.save(15, _state("b", 15)) and mgr.save(20, _state("b", 20))
        assert mgr.all_steps() == [20]
    after = _files(node)
    assert {k: v for k, v in after.items() if k in before} == before


# ------------------------------------------------------------------------------ two ranks


def _run_b(rank: int, world: int, nodes: str, root: str, steps: list[int]) -> dict[str, Any]:
    """Run B on two nodes with one replica: what it lists and restores, then its saves."""
    out: dict[str, Any] = {}
    with _manager(rank, nodes, [0, 1], root, 1) as mgr:
        out["listed"] = mgr.all_steps()
        out["restored"] = mgr.restore_latest(_target_rank())
        out["saved"] = [mgr.save(s, _rank_state(rank, s, 2)) for s in steps]
        out["all"] = mgr.all_steps()
    return out


def _target_rank() -> dict[str, Any]:
    return {"w": torch.zeros(257), "ramp": torch.zeros(100, dtype=torch.int64),
            "meta": {"rank": -1, "step": -1, "tag": -1}}


def test_replicas_and_heal_leave_another_roots_steps_alone(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes"
    root_a, root_b = str(tmp_path / "a"), str(tmp_path / "b")
    run_ranks(_train, 2, str(nodes), [0, 1], root_a, 1, [1, 2, 3], 1, "sync", timeout_s=120)
    # Run A's own step 3 goes on both nodes (by hand); its replicas stay.
    for r in (0, 1):
        for p in sorted((nodes / f"node{r}" / f"rank-{r}" / "3").iterdir()):
            p.unlink()
        (nodes / f"node{r}" / f"rank-{r}" / "3").rmdir()
    before = {n: _files(nodes / n) for n in ("node0", "node1")}
    # Run B: nothing of A's listed or restored. Step 2 (A's own steps there) skips the local
    # tier (so save() returns False: nothing was due elsewhere); step 3 (only A's replicas
    # there) is saved, its replicas refused; 4 and 5 as usual, retention keeping 2 of B's steps.
    res = run_ranks(_run_b, 2, str(nodes), root_b, [2, 3, 4, 5], timeout_s=120)
    for r in res:
        assert r["listed"] == [] and r["restored"] is None, res
        assert r["saved"] == [False, True, True, True], res
        assert r["all"] == [4, 5], res
    for n in ("node0", "node1"):
        after = _files(nodes / n)
        assert {k: v for k, v in after.items() if k in before[n]} == before[n], n
    for r in (0, 1):
        held = _held(str(nodes), r, r)
        assert held["own"] == [2, 4, 5] and held[f"rank-{1 - r}"] == [2, 3, 4, 5], held
    # Node 1 lost: run B heals its part of step 5 from node 0's replica, beside A's files.
    before = {"node0": _files(nodes / "node0")}
    for p in sorted((nodes / "node1").rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    healed = run_ranks(_resume, 2, str(nodes), [0, 1], root_b, 1, 2, timeout_s=120)
    assert all(r["restored"] == 5 and r["exact"] for r in healed), healed
    after = _files(nodes / "node0")
    assert {k: v for k, v in after.items() if k in before["node0"]} == before["node0"]


# ------------------------------------------- manifests this version cannot read (one process)


def _manifest(node: Path, step: int, *, rank: int = 0) -> Path:
    return node / f"rank-{rank}" / str(step) / "commit.json"


def _newer_format(node: Path, *steps: int) -> None:
    """Make ``steps`` look written by a newer ckptmgr: a manifest this version cannot decode."""
    for s in steps:
        doc = json.loads(_manifest(node, s).read_text())
        doc["format_version"] = 99
        _manifest(node, s).write_text(json.dumps(doc))


def test_another_roots_step_this_version_cannot_decode_is_left_alone(tmp_path: Path) -> None:
    # Run A's step 10 was written by a newer ckptmgr (format_version 99): this version cannot
    # decode its manifest, but the root recorded in it still says whose it is. Run B neither
    # lists, deletes nor writes over it; run A (its root) cleans it up as any damaged step of
    # its own.
    a, node = _run_a(tmp_path)
    _newer_format(node, 10)
    before = _files(node)
    with _mgr(tmp_path / "b", node, local_max_to_keep=1) as mgr:
        assert mgr.all_steps() == []
        assert mgr.save(10, _state("b", 10)) is False  # skips the local tier
        for s in (15, 20):  # local retention (keep 1) runs after each save
            assert mgr.save(s, _state("b", s))
        assert mgr.all_steps() == [20]
    after = _files(node)
    assert {k: v for k, v in after.items() if k in before} == before
    with _mgr(a, node) as mgr:
        assert mgr.all_steps() == [5]
        assert mgr.save(25, _state("a", 25))
    assert not (node / "rank-0" / "10").exists()


@pytest.fixture
def failing_reads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Paths (relative to a local root) whose reads fail with EIO while they are in the set: an
    I/O error on those files only (the disk cannot be made to fail on demand)."""
    from ckptmgr.errors import StorageError
    from ckptmgr.storage.local import LocalStorage

    failing: set[str] = set()
    read = LocalStorage.read_bytes

    def read_bytes(self: LocalStorage, path: str, start: int = 0,
                   length: int | None = None) -> bytes:
        if path in failing:
            raise StorageError(f"read failed for {self.url}/{path}: Input/output error "
                               "(injected)") from OSError(5, "Input/output error")
        return read(self, path, start, length)

    monkeypatch.setattr(LocalStorage, "read_bytes", read_bytes)
    return failing


def test_a_step_whose_manifest_cannot_be_read_is_neither_deleted_nor_overwritten(
        tmp_path: Path, failing_reads: set[str]) -> None:
    # While run A's manifests cannot be read (EIO), run B cannot tell whose steps they are: it
    # never deletes or writes over them (nor lists them); once they read again they are found
    # to be run A's, still left alone. Run A then has them all.
    a, node = _run_a(tmp_path)
    before = _files(node)
    failing_reads.update({"5/commit.json", "10/commit.json"})
    with _mgr(tmp_path / "b", node, local_max_to_keep=1) as mgr:
        assert mgr.all_steps() == []
        assert mgr.save(10, _state("b", 10)) is False  # skips the local tier
        for s in (15, 20):  # local retention (keep 1) runs after each save
            assert mgr.save(s, _state("b", s))
        failing_reads.clear()
        assert mgr.save(25, _state("b", 25))
        assert mgr.all_steps() == [25]
    after = _files(node)
    assert {k: v for k, v in after.items() if k in before} == before
    with _mgr(a, node) as mgr:
        assert mgr.all_steps() == [5, 10]
        target = _target()
        assert mgr.restore_latest(target) == 10 and _is(target, "a", 10)


def test_a_step_appearing_with_an_unreadable_manifest_is_not_overwritten(
        tmp_path: Path, failing_reads: set[str]) -> None:
    # Run A's step 10 is moved in after run B opened, and its manifest cannot be read: B's
    # save of step 10 fails on the local tier instead of writing over it.
    a, node = _run_a(tmp_path)
    shutil.move(node / "rank-0" / "10", tmp_path / "a10")
    with _mgr(tmp_path / "b", node) as mgr:
        assert mgr.save(5, _state("b", 5)) is False  # run A's step 5: skipped
        failing_reads.add("10/commit.json")
        shutil.move(tmp_path / "a10", node / "rank-0" / "10")
        before = _files(node / "rank-0" / "10")
        with pytest.raises(ckptmgr.errors.SaveError, match="step 10"):
            mgr.save(10, _state("b", 10))
        assert mgr.save(15, _state("b", 15))
        assert _files(node / "rank-0" / "10") == before
        failing_reads.clear()
    with _mgr(a, node) as mgr:
        assert mgr.all_steps() == [5, 10]


# -------------------------------------------------------- replicas of another root (one process)


def _foreign_replica(a_node: Path, node: Path, step: int) -> Path:
    """Run A's step ``step`` placed where this node holds rank 1's replicas."""
    dest = node / "rank-0" / "replicas" / "rank-1" / str(step)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(a_node / "rank-0" / str(step), dest)
    return dest


def test_another_roots_replica_appearing_after_open_is_not_pruned(tmp_path: Path) -> None:
    # One process with local_replicas=1 holds no replicas of its own (one node) but prunes what
    # its replica directories hold: run A's replica moved in after B opened is not B's to delete.
    _, a_node = _run_a(tmp_path)
    node = tmp_path / "node-b"
    with _mgr(tmp_path / "b", node, local_replicas=1) as mgr:
        assert mgr.save(5, _state("b", 5))
        replica = _foreign_replica(a_node, node, 10)
        before = _files(replica)
        for s in (15, 20, 25):
            assert mgr.save(s, _state("b", s))
        assert _files(replica) == before


def test_another_roots_replica_removed_frees_its_place(tmp_path: Path) -> None:
    # Run A's replica (rank 1, step 20) is there when B opens, then removed by hand; a replica of
    # B's own at that place later is B's: local retention deletes it as any other (it was kept
    # forever: the replica counted as another root's).
    _, a_node = _run_a(tmp_path, (5, 10, 20))
    node = tmp_path / "node-b"
    _foreign_replica(a_node, node, 20)
    with _mgr(tmp_path / "b", node, local_replicas=1) as mgr:
        replica = node / "rank-0" / "replicas" / "rank-1" / "20"
        shutil.rmtree(replica)
        assert mgr.save(20, _state("b", 20))
        shutil.copytree(node / "rank-0" / "20", replica)  # B's step 20, as a replica
        for s in (25, 30):
            assert mgr.save(s, _state("b", s))
        assert not replica.exists()


@pytest.mark.parametrize("spelling", ["{a}/", "./a/", "file://{a}/", "link/"])
def test_an_upload_record_names_this_root_in_another_spelling(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str) -> None:
    # Steps written before roots were recorded name the root as their upload record shows it
    # (the user's spelling): another spelling of this run's root is this run's root.
    a, node = _run_a(tmp_path)
    (tmp_path / "link").symlink_to(a)
    monkeypatch.chdir(tmp_path)
    _strip_root(node, upload_root=spelling.format(a=a))
    with _mgr(a, node) as mgr:
        assert mgr.all_steps() == [5, 10]
        target = _target()
        assert mgr.restore_latest(target) == 10 and _is(target, "a", 10)


def test_a_running_job_of_another_root_holds_the_local_path(tmp_path: Path) -> None:
    """Two jobs at the same time cannot share a local_path (the lease is the directory's): the
    second is refused, and the message says to give each job its own local_path instead of
    suggesting take_over alone."""
    node = str(tmp_path / "node")
    refused = r"local_path.*jobs running at the same time need a local_path each"
    with ckptmgr.CheckpointManager(str(tmp_path / "a"), local_path=node, local_interval=5,
                                   save_interval=1000), pytest.raises(LeaseError, match=refused):
        ckptmgr.CheckpointManager(str(tmp_path / "b"), local_path=node, local_interval=5,
                                  save_interval=1000)


def _commit_json(node: Path, step: int) -> Path:
    return next((node / "rank-0").glob(f"{step}/commit.json"))


def _name_a_nul_root(manifest: Path) -> None:
    """The step's manifest names no root but an upload root holding a NUL byte (bytes from
    storage: crafted or damaged), in a format this version cannot decode."""
    doc = json.loads(manifest.read_text())
    doc["metadata"][LAYOUT].pop("root", None)
    doc["metadata"][UPLOAD] = {"root": "x\u0000y"}
    doc["format_version"] = 99
    manifest.write_text(json.dumps(doc))


def test_crafted_records_in_the_local_tier_never_stop_the_run(tmp_path: Path) -> None:
    """R3: an upload root with a NUL byte (os.path.realpath raised ValueError: construction
    failed at every start, and a step moved in later failed every save), and a dropped-steps
    record nested 100,000 deep (RecursionError at construction). Now: the step is another
    root's (kept, not listed), the record is reported and taken as empty."""
    a, node = tmp_path / "a", tmp_path / "node"

    def open_a() -> ckptmgr.CheckpointManager:
        return ckptmgr.CheckpointManager(str(a), local_path=str(node), local_interval=5,
                                         save_interval=1000, local_max_to_keep=2)

    with open_a() as mgr:
        for step in (5, 10):
            mgr.save(step, _state("a", step))
    _name_a_nul_root(_commit_json(node, 10))
    with open_a() as mgr:  # present at construction
        assert mgr.all_steps() == [5]
        moved = _commit_json(node, 5).parent.parent / "15"
        shutil.copytree(_commit_json(node, 5).parent, moved)
        _name_a_nul_root(moved / "commit.json")
        mgr.save(20, _state("a", 20))  # moved in after construction
        assert mgr.all_steps() == [5, 20]
    assert (node / "rank-0" / "10").is_dir() and moved.is_dir()  # never deleted
    (node / "rank-0" / ".ckptmgr-local-dropped.json").write_bytes(b"[" * 100_000)
    with open_a() as mgr:
        assert mgr.all_steps() == [5, 20]
