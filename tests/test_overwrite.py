"""Re-saving a committed step (DESIGN.md section 5).

Refused without ``overwrite=True``, leaving the old data intact; with it, the old version stays
restorable until the new manifest replaces it, and a SIGKILL at any moment leaves exactly one
complete version."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
import torch
from _faulty import Gate
from _faulty import install as install_faulty
from _faulty import reset as reset_faulty

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

# A zygote imports torch once (seconds on a small machine), then forks one writer per kill. Each
# writer overwrites step 7 again and again with distinguishable versions until the test SIGKILLs
# it; the zygote reaps it and reports how it ended.
_ZYGOTE = r"""
import os, sys, torch, ckptmgr

def overwrite_forever(root, first):
    mgr = ckptmgr.CheckpointManager(root, save_interval=1, overwrite=True,
                                    chkpt_on_preemption=False)
    print("pid", os.getpid(), flush=True)
    for v in range(first, first + 1_000_000):
        state = {"w": torch.full((1024, 1024), float(v)), "ramp": torch.arange(100_000) + v,
                 "v": v, "tag": f"version-{v}"}
        print("begin", v, flush=True)
        mgr.save(7, state, metrics={"v": float(v)})
        print("done", v, flush=True)

for line in sys.stdin:
    root, first = line.split()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            overwrite_forever(root, int(first))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    print("exit", pid, os.waitstatus_to_exitcode(status), flush=True)
"""


def _big_version(mgr: CheckpointManager) -> int:
    out: dict[str, Any] = {"w": torch.zeros(1024, 1024), "ramp": torch.zeros(100_000,
                           dtype=torch.int64), "v": -1, "tag": ""}
    mgr.restore(7, out)
    v = out["v"]
    assert isinstance(v, int)
    assert torch.equal(out["w"], torch.full((1024, 1024), float(v))), "torn: w of another version"
    assert torch.equal(out["ramp"], torch.arange(100_000) + v), "torn: ramp of another version"
    assert out["tag"] == f"version-{v}"
    assert mgr.step_info(7).metrics == {"v": float(v)}, "torn: manifest of another version"
    return v


@pytest.mark.slow
def test_sigkill_during_overwrites_leaves_one_complete_version(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    roots = [str(tmp_path_factory.mktemp("ow") / "run") for _ in range(2)]
    kills = 10
    outcomes: list[str] = []
    last: dict[str, int] = {}
    with subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as zygote:
        assert zygote.stdin is not None and zygote.stdout is not None
        try:
            for kill in range(kills):
                root = roots[kill % 2]
                first = 1000 * (kill + 1)
                zygote.stdin.write(f"{root} {first}\n")
                zygote.stdin.flush()
                seen: list[tuple[str, int]] = []
                # Let one overwrite commit (step 7 exists from then on), then kill at a varying
                # moment after a later one began.
                target = ("begin", first + 1 + kill % 3)
                while not seen or seen[-1] != target:
                    line = zygote.stdout.readline()
                    assert line, zygote.communicate()[1]
                    word, num = line.split()
                    seen.append((word, int(num)))
                time.sleep(0.006 * kill)  # 0 to 54 ms: sweeps the phases of a ~50 ms save
                os.kill(seen[0][1], signal.SIGKILL)
                while True:  # what it printed before dying, then the zygote's report
                    word, num, *code = zygote.stdout.readline().split()
                    if word == "exit":
                        assert int(code[0]) == -signal.SIGKILL, code
                        break
                    seen.append((word, int(num)))
                done = [n for w, n in seen if w == "done"]
                in_flight = seen[-1][1] if seen[-1][0] == "begin" else None
                with CheckpointManager(root, save_interval=1, chkpt_on_preemption=False) as mgr:
                    assert mgr.all_steps() == [7]
                    v = _big_version(mgr)  # every byte checked against the manifest
                assert v in (done[-1], in_flight), (v, done[-1], in_flight)
                outcomes.append("new" if v == in_flight else "old")
                last[root] = v
        finally:
            zygote.communicate(timeout=60)  # EOF on stdin ends the zygote
    assert len(outcomes) == kills
    # A clean overwrite after all those kills works and leaves only its own files behind.
    for root in roots:
        with CheckpointManager(root, save_interval=1, overwrite=True) as mgr:
            assert _big_version(mgr) == last[root]
            mgr.save(7, {"w": torch.full((1024, 1024), 5.0), "ramp": torch.arange(100_000) + 5,
                         "v": 5, "tag": "version-5"}, metrics={"v": 5.0})
            assert _big_version(mgr) == 5
            info = mgr.step_info(7)
        assert sorted(os.listdir(root)) == ["7"]
        # (a crash while the manifest was being replaced also leaves a commit.json.tmp-* file:
        # test_crashed_overwrite_leftovers_are_removed_by_the_next_overwrite covers it)
        left = [n for n in os.listdir(os.path.join(root, "7")) if not n.startswith("commit.json.")]
        assert sorted(left) == sorted(["commit.json", *(f.path for f in info.files)])
    print("outcomes:", outcomes)


def _plant_crash_leftovers(root: str, step: int, *, manifest_tmp: bool) -> list[str]:
    """The files a writer SIGKILLed during an overwrite leaves in the step directory (as the test
    above observes): its attempt's data and metadata files, and its half-replaced manifest."""
    names = ["data-0123456789ab-r00000-000.bin", "metadata-0123456789ab.json"]
    if manifest_tmp:
        names.append("commit.json.tmp-4242-7f00deadbeef")
    fs, path = fsspec.core.url_to_fs(root)
    for name in names:
        fs.pipe_file(f"{path.rstrip('/')}/{step}/{name}", b"partial")
    return names


def test_crashed_overwrite_data_files_are_removed_by_the_next_overwrite(root: str) -> None:
    with CheckpointManager(root, save_interval=1, overwrite=True) as mgr:
        mgr.save(7, _state(1))
        _plant_crash_leftovers(root, 7, manifest_tmp=False)
        assert _restored_version(mgr, 7) == 1  # the leftovers do not disturb the committed one
        mgr.save(7, _state(2))
        info = mgr.step_info(7)
    assert set(_listing(root)) == {"7/commit.json", *(f"7/{f.path}" for f in info.files)}


def test_crashed_overwrite_leftovers_are_removed_by_the_next_overwrite(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=1, overwrite=True) as mgr:
        mgr.save(7, _state(1))
        _plant_crash_leftovers(local_root, 7, manifest_tmp=True)
        mgr.save(7, _state(2))
        info = mgr.step_info(7)
    assert set(_listing(local_root)) == {"7/commit.json", *(f"7/{f.path}" for f in info.files)}
