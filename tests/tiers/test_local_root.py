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
