"""The node-local tier (ckptmgr/local_tier.py) at its seams: a re-save that failed on one rank, a
local step damaged or wiped while the manager is open, and reads of files that are not regular."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _procs import run_ranks

import ckptmgr
from ckptmgr.errors import CkptmgrError, CorruptCheckpointError, SaveError, StorageError


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((64,), float(v)), "extra": {"v": v}}


def _resave_fails_on_rank_1(rank: int, world: int, root: str, nodes: str) -> Any:
    import ckptmgr.local_tier as local_tier

    local = os.path.join(nodes, f"node{rank}")
    state = _state(0)
    out: dict[str, Any] = {}
    with ckptmgr.CheckpointManager(root, save_interval=1000, local_path=local,
                                   local_interval=1) as m:
        state["w"].fill_(1.0)
        assert m.save(1, state)
        state["w"].fill_(2.0)
        real = local_tier.write_step
        if rank == 1:
            def disk_full(*args: Any, **kwargs: Any) -> Any:
                raise OSError(28, "No space left on device (injected)")
            local_tier.write_step = disk_full  # type: ignore[assignment]
        try:
            m.save(1, state)
            out["resave"] = "ok"
        except SaveError as e:
            out["resave"] = f"SaveError: {e}"
        finally:
            local_tier.write_step = real  # type: ignore[assignment]
        out["listed"] = m.all_steps()
    with ckptmgr.CheckpointManager(root, save_interval=1000, local_path=local,
                                   local_interval=1) as m:
        out["listed_after_restart"] = m.all_steps()
        if 1 in out["listed_after_restart"]:
            target = _state(0)
            m.restore(1, target)
            out["value"] = float(target["w"][0])
    return out


def test_local_step_whose_resave_failed_on_one_rank_is_whole_nowhere(tmp_path: Path) -> None:
    res = run_ranks(_resave_fails_on_rank_1, 2, str(tmp_path / "root"), str(tmp_path / "nodes"),
                    timeout_s=120)
    for r in res:
        assert r["resave"].startswith("SaveError"), res
        assert 1 not in r["listed"], res
        assert 1 not in r["listed_after_restart"], res


@pytest.mark.parametrize("damage", ["flip", "manifest", "truncate"])
def test_local_only_step_damaged_while_open_is_corrupt_and_target_untouched(
        tmp_path: Path, damage: str) -> None:
    local = tmp_path / "local"
    with ckptmgr.CheckpointManager(str(tmp_path / "root"), save_interval=100,
                                   local_path=str(local), local_interval=5) as m:
        assert m.save(5, _state(5))
        assert m.all_steps() == [5]
        sdir = local / "rank-0" / "5"
        data = sorted(p for p in sdir.iterdir() if p.name.startswith("data-"))[0]
        if damage == "flip":
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0xFF
            data.write_bytes(bytes(raw))
        elif damage == "manifest":
            (sdir / "commit.json").unlink()
        else:
            data.write_bytes(data.read_bytes()[:-8])
        target = _state(-1)
        with pytest.raises(CorruptCheckpointError, match="local tier"):
            m.restore(5, target)
        assert torch.equal(target["w"], torch.full((64,), -1.0)), "damaged bytes reached it"


def test_local_directory_wiped_while_open_saves_continue(tmp_path: Path) -> None:
    local = tmp_path / "local"
    with ckptmgr.CheckpointManager(str(tmp_path / "root"), save_interval=2,
                                   local_path=str(local), local_interval=1) as m:
        assert m.save(1, _state(1))
        shutil.rmtree(local)
        for step in range(2, 6):
            assert m.save(step, _state(step)), step
        assert m.all_steps()[-1] == 5
        target = _state(0)
        m.restore(5, target)
        assert float(target["w"][0]) == 5.0


def test_local_reads_refuse_non_regular_files(tmp_path: Path) -> None:
    from ckptmgr.storage import open_storage

    os.mkfifo(tmp_path / "f")
    storage = open_storage(str(tmp_path))
    got: list[BaseException | bytes] = []

    def read() -> None:
        try:
            got.append(storage.read_bytes("f"))
        except BaseException as e:
            got.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=60)
    if reader.is_alive():  # blocked in open(): a writer end releases it, then fail
        fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        pytest.fail("reading a FIFO blocked")
    assert isinstance(got[0], StorageError) and "FIFO" in str(got[0]), got
    assert isinstance(got[0], CkptmgrError)


def test_one_durable_root_through_a_link_is_one_root(tmp_path: Path) -> None:
    """The durable root named through a symbolic link, then by its real path (a restart under
    the other spelling): the local steps are this run's, listed and restored (they looked like
    another run's, and restore_latest found nothing)."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    node = str(tmp_path / "node")
    with ckptmgr.CheckpointManager(str(tmp_path / "link"), local_path=node, local_interval=5,
                                   save_interval=1000) as mgr:
        for step in (5, 10):
            mgr.save(step, {"w": torch.full((8,), float(step))})
    with ckptmgr.CheckpointManager(str(tmp_path / "real"), local_path=node, local_interval=5,
                                   save_interval=1000) as mgr:
        assert mgr.all_steps() == [5, 10]
        target = {"w": torch.zeros(8)}
        assert mgr.restore_latest(target) == 10 and target["w"][0].item() == 10.0
