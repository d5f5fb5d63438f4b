"""Re-saving a committed step (DESIGN.md section 5).

Refused without ``overwrite=True``, leaving the old data intact; with it, the old version stays
restorable until the new manifest replaces it, and a SIGKILL at any moment leaves exactly one
complete version."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import torch
from _faulty import Gate
from _faulty import install as install_faulty
from _faulty import reset as reset_faulty
from _procs import FS_GATE, Zygote

from ckptmgr import (
    CheckpointExistsError,
    CheckpointManager,
    SaveError,
    StateMismatchError,
)


def _state(v: int) -> dict[str, Any]:
    return {"w": torch.full((64, 32), float(v)), "ramp": torch.arange(100, dtype=torch.int64) + v,
            "v": v, "tag": f"version-{v}"}


def _target() -> dict[str, Any]:
    return {"w": torch.zeros(64, 32), "ramp": torch.zeros(100, dtype=torch.int64), "v": -1,
            "tag": ""}


def _restored_version(mgr: CheckpointManager, step: int) -> int:
    """Restore ``step`` and return its version, checking every part belongs to that version."""
    out = _target()
    mgr.restore(step, out)  # verify=True: sizes and checksums of every file read
    v = out["v"]
    assert isinstance(v, int)
    assert torch.equal(out["w"], torch.full((64, 32), float(v))), "w from another version"
    assert torch.equal(out["ramp"], torch.arange(100, dtype=torch.int64) + v)
    assert out["tag"] == f"version-{v}"
    assert mgr.step_info(step).metrics.get("v", float(v)) == float(v), "manifest of another one"
    return v


def _listing(root: str) -> dict[str, int]:
    """Every file under ``root`` (any URL): relative path -> size."""
    fs, path = fsspec.core.url_to_fs(root)
    if not fs.exists(path):
        return {}
    prefix = path.rstrip("/") + "/"
    return {p[len(prefix):]: int(d["size"]) for p, d in fs.find(path, detail=True).items()}


def _read(root: str, rel: str) -> bytes:
    fs, path = fsspec.core.url_to_fs(root)
    return fs.cat_file(path.rstrip("/") + "/" + rel)  # type: ignore[no-any-return]


# ------------------------------------------------------------------------ refused re-saves


def test_refused_resave_keeps_the_old_data_intact(root: str) -> None:
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(3, _state(1), metrics={"v": 1.0}, metadata={"run": "a"})
        before = _listing(root)
        blobs = {rel: _read(root, rel) for rel in before}
        info = mgr.step_info(3)
        # Due saves of a committed step are skipped (one warning); forced ones are refused.
        assert mgr.save(3, _state(2)) is False
        assert mgr.save_async(3, _state(2)) is False
        assert mgr.save(3, {"other": torch.ones(1)}) is False
        attempts: list[Any] = [
            lambda: mgr.save(3, _state(2), force=True, metrics={"v": 2.0}),
            lambda: mgr.save_async(3, _state(2), force=True),  # refused on the caller's thread
            lambda: mgr.save(3, {"other": torch.ones(1)}, force=True),
        ]
        for attempt in attempts:
            with pytest.raises(CheckpointExistsError, match="overwrite=True") as ei:
                attempt()
            assert isinstance(ei.value, FileExistsError)
            assert "step 3" in str(ei.value)
        mgr.join()  # nothing was queued
        assert _listing(root) == before  # not one byte written, no leftover, no staging dir
        assert {rel: _read(root, rel) for rel in before} == blobs
        assert mgr.step_info(3) == info
        assert _restored_version(mgr, 3) == 1
        assert mgr.save(4, _state(4)) is True  # the manager is still usable
    with CheckpointManager(root, save_interval=1) as mgr:  # a restarted run is refused too
        assert mgr.save(3, _state(5)) is False
        with pytest.raises(CheckpointExistsError):
            mgr.save(3, _state(5), force=True)
        assert _restored_version(mgr, 3) == 1
        assert mgr.all_steps() == [3, 4]


# ------------------------------------------------------------------------------ overwrites


def test_overwrite_replaces_content_keys_metrics_and_files(root: str) -> None:
    with CheckpointManager(root, save_interval=1, overwrite=True, max_to_keep=5,
                           best_metric="loss") as mgr:
        mgr.save(3, {"a": torch.ones(4), "n": 1}, metrics={"loss": 1.0}, metadata={"who": "old"})
        mgr.save(5, {"a": torch.ones(4), "n": 5}, metrics={"loss": 0.7})
        old = mgr.step_info(3)
        assert mgr.best_step() == 5
        mgr.save(3, {"b": torch.full((2, 3), 2.0), "n": 2}, metrics={"loss": 0.5},
                 metadata={"who": "new"})
        new = mgr.step_info(3)
        assert mgr.all_steps() == [3, 5]
        assert mgr.best_step() == 3  # the new metrics count at once ...
        assert new.metrics == {"loss": 0.5} and new.metadata == {"who": "new"}
        assert new.time >= old.time
        assert not {f.path for f in new.files} & {f.path for f in old.files}  # fresh names
        out: dict[str, Any] = {"b": torch.zeros(2, 3), "n": 0}
        mgr.restore(3, out)
        assert torch.equal(out["b"], torch.full((2, 3), 2.0)) and out["n"] == 2
        with pytest.raises(StateMismatchError, match="a"):
            mgr.restore(3, {"a": torch.zeros(4)})  # the old keys are gone with the old version
    files = {rel for rel in _listing(root) if rel.startswith("3/")}
    assert files == {"3/commit.json", *(f"3/{f.path}" for f in new.files)}  # old files deleted
    with CheckpointManager(root, save_interval=1, max_to_keep=5, best_metric="loss") as mgr:
        assert mgr.best_step() == 3  # ... and after a restart (read back from the manifest)
        assert mgr.step_info(3) == new


def test_overwrite_in_the_background(local_root: str) -> None:
    root = local_root
    with CheckpointManager(root, save_interval=1, overwrite=True) as mgr:
        mgr.save(2, _state(1))
        assert mgr.save_async(2, _state(2)) is True
        mgr.join()
        assert _restored_version(mgr, 2) == 2
        mgr.save_async(2, _state(3))
    with CheckpointManager(root, save_interval=1) as mgr:
        assert mgr.all_steps() == [2] and _restored_version(mgr, 2) == 3


def test_overwrite_with_retention(local_root: str) -> None:
    root = local_root
    with CheckpointManager(root, save_interval=1, overwrite=True, max_to_keep=2) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s))
        assert mgr.all_steps() == [2, 3]
        mgr.save(3, _state(30))
        mgr.save(2, _state(20))
        assert mgr.all_steps() == [2, 3]  # overwriting is not a new step: nothing pruned
        assert [_restored_version(mgr, s) for s in (2, 3)] == [20, 30]
        mgr.save(1, _state(10))  # re-saving a pruned step: the save that commits it keeps it
        assert mgr.all_steps() == [1, 2, 3]
        mgr.save(4, _state(4))  # the next save's retention counts by step number
        assert mgr.all_steps() == [3, 4]
    assert {rel.split("/")[0] for rel in _listing(root)} == {"3", "4"}


@pytest.fixture
def faulty_root() -> Iterator[str]:
    install_faulty()
    url = f"faulty://overwrite-tests/{uuid.uuid4().hex}"
    yield url
    reset_faulty()
    fs = fsspec.filesystem("faulty")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def test_failed_overwrite_leaves_the_old_version(faulty_root: str) -> None:
    fs_cls = install_faulty()
    with CheckpointManager(faulty_root, save_interval=1, overwrite=True) as mgr:
        mgr.save(4, _state(1), metrics={"v": 1.0})
        before = _listing(faulty_root)
        info = mgr.step_info(4)
        fs_cls.fail_data = True
        with pytest.raises(SaveError) as ei:
            mgr.save(4, _state(2), metrics={"v": 2.0})
        assert ei.value.step == 4
        fs_cls.fail_data = False
        assert _listing(faulty_root) == before  # the failed attempt's files are removed
        assert mgr.step_info(4) == info and _restored_version(mgr, 4) == 1
        mgr.save(4, _state(3), metrics={"v": 3.0})  # and a later overwrite works
        assert _restored_version(mgr, 4) == 3


def test_old_version_is_restorable_while_the_overwrite_is_in_flight(faulty_root: str) -> None:
    fs_cls = install_faulty()
    with CheckpointManager(faulty_root, save_interval=1, overwrite=True) as writer:
        writer.save(6, _state(1), metrics={"v": 1.0})
        fs_cls.gate = gate = Gate()  # the new attempt's data files wait here
        writer.save_async(6, _state(2), metrics={"v": 2.0})
        gate.wait_arrived()
        with CheckpointManager(faulty_root, save_interval=1, read_only=True) as reader:
            assert reader.all_steps() == [6]
            assert _restored_version(reader, 6) == 1  # mid-overwrite: the old one, whole
        gate.open()
        writer.join()
        assert _restored_version(writer, 6) == 2
    with CheckpointManager(faulty_root, save_interval=1) as reader:
        assert _restored_version(reader, 6) == 2


# ---------------------------------------------------------------------------- SIGKILL loop

# A writer (forked from the session zygote) overwrites step 7 once, then arms a gate (FS_GATE: its
# ``kill_at``-th file-system call from there prints "gate ..." and blocks until the test SIGKILLs
# it), so every call of an overwrite gets a kill, by construction rather than by timing. With
# kill_at=0 it counts the calls of one overwrite instead and exits.
_WRITER = FS_GATE + r"""
import sys, torch, ckptmgr

def overwrite(mgr, v):
    state = {"w": torch.full((256, 256), float(v)), "ramp": torch.arange(25_000) + v,
             "v": v, "tag": f"version-{v}"}
    print("begin", v, flush=True)
    mgr.save(7, state, metrics={"v": float(v)})
    print("done", v, flush=True)

root, first, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mgr = ckptmgr.CheckpointManager(root, save_interval=1, overwrite=True, chkpt_on_preemption=False)
overwrite(mgr, first)
count = arm(kill_at)
if kill_at == 0:
    overwrite(mgr, first + 1)
    print("calls", count[0], flush=True)
    sys.exit(0)
for v in range(first + 1, first + 1_000_000):
    overwrite(mgr, v)
"""


def _big_version(mgr: CheckpointManager) -> int:
    out: dict[str, Any] = {"w": torch.zeros(256, 256), "ramp": torch.zeros(25_000,
                           dtype=torch.int64), "v": -1, "tag": ""}
    mgr.restore(7, out)
    v = out["v"]
    assert isinstance(v, int)
    assert torch.equal(out["w"], torch.full((256, 256), float(v))), "torn: w of another version"
    assert torch.equal(out["ramp"], torch.arange(25_000) + v), "torn: ramp of another version"
    assert out["tag"] == f"version-{v}"
    assert mgr.step_info(7).metrics == {"v": float(v)}, "torn: manifest of another version"
    return v


def _writer(zygote: Zygote, root: str, first: int, kill_at: int) -> tuple[list[tuple[str, int]],
                                                                           int]:
    """One writer; SIGKILLed at its gate (unless counting). Its lines and exit status."""
    run = zygote.spawn([root, str(first), str(kill_at)], code=_WRITER)
    assert run.stdout is not None
    seen: list[tuple[str, int]] = []
    while line := run.stdout.readline():
        word, arg = line.split()
        if word == "gate":
            run.kill()
            seen.append((word, 0))
            break
        seen.append((word, int(arg)))
    out, err = run.communicate(120)
    seen += [(w, int(a)) for w, a in (x.split() for x in out.splitlines())]
    assert run.returncode in (0, -signal.SIGKILL), (run.returncode, seen, err)
    return seen, run.returncode


@pytest.mark.slow
def test_sigkill_during_overwrites_leaves_one_complete_version(
        tmp_path_factory: pytest.TempPathFactory, zygote: Zygote) -> None:
    roots = [str(tmp_path_factory.mktemp("ow") / "run") for _ in range(2)]
    outcomes: list[str] = []
    counted, code = _writer(zygote, roots[1], 1, 0)
    assert code == 0, counted
    (kills,) = [n for w, n in counted if w == "calls"]
    assert kills >= 3, counted  # data, manifest, old version's files: one call each
    last: dict[str, int] = {roots[1]: 2}
    for kill in range(kills):
        root = roots[kill % 2]
        first = 1000 * (kill + 1)
        seen, code = _writer(zygote, root, first, kill + 1)
        assert [w for w, _ in seen].count("gate") == 1, seen  # killed at the gate
        assert code == -signal.SIGKILL, seen
        done = [n for w, n in seen if w == "done"]
        begun = [n for w, n in seen if w == "begin"]
        in_flight = begun[-1] if begun[-1] not in done else None
        with CheckpointManager(root, save_interval=1, chkpt_on_preemption=False) as mgr:
            assert mgr.all_steps() == [7]
            v = _big_version(mgr)  # every byte checked against the manifest
        assert v in (done[-1], in_flight), (v, done[-1], in_flight)
        outcomes.append("new" if v == in_flight else "old")
        last[root] = v
    assert len(outcomes) == kills
    assert "old" in outcomes  # a kill before the new manifest lands keeps the old version
    # A clean overwrite after all those kills works and leaves only its own files behind.
    for root in roots:
        with CheckpointManager(root, save_interval=1, overwrite=True) as mgr:
            assert _big_version(mgr) == last[root]
            mgr.save(7, {"w": torch.full((256, 256), 5.0), "ramp": torch.arange(25_000) + 5,
                         "v": 5, "tag": "version-5"}, metrics={"v": 5.0})
            assert _big_version(mgr) == 5
