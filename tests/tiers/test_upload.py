"""Durable copies made from the local tier's files in the background (ckptmgr.uploader).

Real files (a local durable root, or ``faulty://`` over memory for held and failing uploads, or
the moto S3 server), real gloo ranks for the collective path. A held upload is a fact the test
arranges (the fault file system's gate holds the durable data writes), never a guess about timing.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _faulty import FaultyFS, Gate, install, reset
from _procs import run_ranks
from test_multitier import WIDTH, s3_url  # noqa: F401 (a fixture, shared with that file)
from test_multitier import _build as _fsdp

import ckptmgr
from ckptmgr import AsyncSaveError
from ckptmgr.errors import CorruptCheckpointError, StorageError


@pytest.fixture
def faulty() -> Iterator[str]:
    fs_cls = install()
    url = f"faulty://upload-tests/{uuid.uuid4().hex}"
    yield url
    reset()
    fs = fs_cls()
    if fs.exists(url):
        fs.rm(url, recursive=True)


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 16, generator=g),
            "b": torch.arange(7, dtype=torch.bfloat16) * step,
            "extra": {"step": step, "name": f"s{step}", "pair": (1, 2.5), "none": None}}


def _target() -> dict[str, Any]:
    return {"w": torch.zeros(64, 16), "b": torch.zeros(7, dtype=torch.bfloat16),
            "extra": {"step": -1, "name": "", "pair": None, "none": 0}}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"])
            and a["extra"] == b["extra"])


def _mgr(durable: str, node: Path, **kw: Any) -> ckptmgr.CheckpointManager:
    kw.setdefault("local_interval", 5)
    return ckptmgr.CheckpointManager(durable, save_interval=10, local_path=str(node), **kw)


def _upload_of_10_fails(mgr: ckptmgr.CheckpointManager) -> AsyncSaveError:
    """Save step 10 (due on both tiers) with retries at once; its upload's failure, raised by
    ``join`` after every try failed."""
    assert mgr._uploads is not None
    mgr._uploads.retry_s = 0.0
    mgr.save_async(10, _state(10))
    with pytest.raises(AsyncSaveError) as err:
        mgr.join()
    assert err.value.step == 10
    return err.value


def _durable_steps(durable: str) -> list[int]:
    with ckptmgr.CheckpointManager(durable, save_interval=10, read_only=True) as reader:
        return reader.all_steps()


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_durable_copy_restores_bit_exact(tmp_path: Path, mode: str) -> None:
    durable = str(tmp_path / "durable")
    with _mgr(durable, tmp_path / "node", async_mode=mode) as mgr:
        for step in range(1, 21):
            mgr.save_async(step, _state(step))
        mgr.join()
        assert mgr.all_steps() == [10, 15, 20]
        assert [mgr.step_info(s).tiers for s in (10, 15, 20)] == [
            ("durable",), ("local",), ("durable", "local")]
        info = mgr.step_info(20)
        assert info.world_size == 1 and "_ckptmgr_upload" not in info.metadata
    # The durable steps alone, read by a manager without a local tier.
    with ckptmgr.CheckpointManager(durable, save_interval=10) as mgr:
        assert mgr.all_steps() == [10, 20]
        assert mgr.step_info(20).metadata == {}
        for step in (10, 20):
            out = _target()
            mgr.restore(step, out)
            assert _equal(out, _state(step)), step


def test_staging_released_while_the_upload_is_held(faulty: str, tmp_path: Path) -> None:
    gate = FaultyFS.gate = Gate()
    node = tmp_path / "node"
    with _mgr(faulty, node) as mgr:
        try:
            assert mgr.save_async(10, _state(10))
            gate.wait_arrived()  # step 10's durable copy is in flight, held at its first file
            # The next due save stages into the same buffers and commits locally meanwhile.
            assert mgr.save_async(20, _state(20))
            mgr._join_saves()  # the save queue's job (the local write) ended; no upload did
            assert (node / "rank-0" / "20" / "commit.json").exists()
            assert not FaultyFS().exists(f"{faulty}/10/commit.json")
            assert mgr.all_steps() == [10, 20]
            assert [mgr.step_info(s).tiers for s in (10, 20)] == [("local",), ("local",)]
        finally:
            gate.open()
        mgr.join()
        assert mgr.step_info(10).tiers == ("durable", "local")
        assert mgr.step_info(20).tiers == ("durable", "local")
        for step in (10, 20):
            out = _target()
            mgr.restore(step, out)
            assert _equal(out, _state(step))


def test_local_retention_keeps_a_step_owed_to_the_durable_tier(faulty: str,
                                                               tmp_path: Path) -> None:
    gate = FaultyFS.gate = Gate()
    node = tmp_path / "node"
    with _mgr(faulty, node, local_max_to_keep=1) as mgr:
        try:
            mgr.save_async(10, _state(10))
            gate.wait_arrived()
            mgr.save_async(15, _state(15))  # local only; retention keeps one step...
            mgr._join_saves()
            assert mgr.all_steps() == [15]  # ...listed, but step 10 stays on disk for its upload
            assert (node / "rank-0" / "10" / "commit.json").exists()
        finally:
            gate.open()
        mgr.join()
        assert mgr.all_steps() == [10, 15]  # 10 from the durable tier now
        mgr.save_async(25, _state(25))
        mgr.join()
        assert not (node / "rank-0" / "10").exists()  # owed no more: local retention took it


def test_an_older_step_saved_again_is_kept_for_its_upload(tmp_path: Path) -> None:
    # Found by the stateful model (S3): an older step due on both tiers is saved locally, and
    # that save's own local retention (the newest 2 steps kept) deleted it before the uploader
    # was given it; its upload then failed with "step 1 is not a committed checkpoint".
    durable, node = str(tmp_path / "durable"), tmp_path / "node"
    with ckptmgr.CheckpointManager(durable, 1, max_to_keep=1, local_path=str(node),
                                   local_interval=1, local_max_to_keep=2) as mgr:
        assert mgr.save_async(2, _state(2))
        assert mgr.save(5, _state(5), force=True)
        assert mgr.save_async(1, _state(1))  # older than both kept local steps
        mgr.join()
        assert mgr.all_steps() == [1, 2, 5]
        assert mgr.step_info(1).tiers == ("durable",)  # not listed locally: not the newest 2
    with ckptmgr.CheckpointManager(durable, 1) as mgr:
        assert mgr.all_steps() == [1, 5]  # a save's own step is never deleted by its retention
        out = _target()
        mgr.restore(1, out)
        assert _equal(out, _state(1))


def test_a_step_kept_only_for_its_upload_is_not_listed_again(tmp_path: Path) -> None:
    # Found by the stateful model: an older step saved again was kept on disk for its upload
    # though retention had dropped it from the listing; after the upload, a later local save's
    # agreement counted it among the newest whole steps again: it was listed, and the step
    # just saved (older) was deleted at once.
    durable, node = str(tmp_path / "durable"), tmp_path / "node"
    with ckptmgr.CheckpointManager(durable, 2, local_path=str(node), local_interval=1,
                                   local_max_to_keep=2) as mgr:
        for step in (4, 5, 2):  # 2: older than both kept local steps, due on both tiers
            assert mgr.save_async(step, _state(step))
        mgr.join()
        assert mgr.all_steps() == [2, 4, 5]
        assert mgr.step_info(2).tiers == ("durable",)
        data = next(p for p in (node / "rank-0" / "5").iterdir() if p.name.startswith("data-"))
        data.write_bytes(data.read_bytes()[:-1])  # local step 5 damaged: not restorable
        with pytest.raises(CorruptCheckpointError):
            mgr.restore(5, _target())
        assert mgr.save(1, _state(1), force=True)
        assert [(s, mgr.step_info(s).tiers) for s in mgr.all_steps()] == [
            (1, ("durable", "local")), (2, ("durable",)), (4, ("durable", "local"))]


def test_a_restart_lists_the_newest_local_steps_and_uploads_an_older_owed_one(
        faulty: str, tmp_path: Path) -> None:
    # Found by the stateful model: a step kept on disk for its durable copy (retention had
    # dropped it from the listing) was listed again by the next job, beside the newest
    # local_max_to_keep steps. It is not listed now, but its owed copy is still made.
    node = tmp_path / "node"
    FaultyFS.fail_data = True
    with _mgr(faulty, node) as mgr:
        assert mgr._uploads is not None
        mgr._uploads.retry_s = 0.0
        mgr.save_async(10, _state(10))
        with pytest.raises(AsyncSaveError):
            mgr.join()
        for step in (15, 25):  # local only
            mgr.save_async(step, _state(step))
        mgr.join()
        assert mgr.all_steps() == [15, 25]
        assert (node / "rank-0" / "10" / "commit.json").exists()  # kept: its copy is owed
    FaultyFS.fail_data = False
    with _mgr(faulty, node) as mgr:
        mgr.join()
        assert [(s, mgr.step_info(s).tiers) for s in mgr.all_steps()] == [
            (10, ("durable",)), (15, ("local",)), (25, ("local",))]
        mgr.save_async(30, _state(30))
        mgr.join()
        assert not (node / "rank-0" / "10").exists()  # uploaded and not listed: deleted
    assert _durable_steps(faulty) == [10, 30]


def test_a_dropped_step_kept_for_its_upload_stays_unlisted_when_a_newer_one_is_lost(
        faulty: str, tmp_path: Path) -> None:
    # Found by a helper (H1): a step local retention dropped but kept on disk for its owed
    # durable copy came back in the listing after a restart once a newer local step was damaged
    # (the restart listed the newest local_max_to_keep whole steps, counting the dropped one).
    # Its drop is recorded on disk now: never listed again, in any order of restarts and upload
    # outcomes, while its owed copy is still made from it.
    node = tmp_path / "node"
    FaultyFS.fail_data = True
    with _mgr(faulty, node) as mgr:
        assert mgr._uploads is not None
        mgr._uploads.retry_s = 0.0
        mgr.save_async(10, _state(10))
        with pytest.raises(AsyncSaveError):
            mgr.join()
        for step in (15, 25):  # local only: step 10 is dropped, kept for its copy
            mgr.save_async(step, _state(step))
        mgr.join()
        assert mgr.all_steps() == [15, 25]
    data = next(p for p in (node / "rank-0" / "25").iterdir() if p.name.startswith("data-"))
    data.write_bytes(data.read_bytes()[:-1])  # the newest local step is lost while it is down
    with _mgr(faulty, node) as mgr:  # its copy fails again: still owed, still kept
        assert mgr._uploads is not None
        mgr._uploads.retry_s = 0.0
        with pytest.raises(AsyncSaveError):
            mgr.join()
        assert mgr.all_steps() == [15]
        assert (node / "rank-0" / "10" / "commit.json").exists()
    FaultyFS.fail_data = False
    with _mgr(faulty, node) as mgr:  # its copy is made from the kept local files
        mgr.join()
        assert [(s, mgr.step_info(s).tiers) for s in mgr.all_steps()] == [
            (10, ("durable",)), (15, ("local",))]
        out = _target()
        mgr.restore(10, out)
        assert _equal(out, _state(10))
        mgr.save_async(20, _state(20))
        mgr.join()
        assert not (node / "rank-0" / "10").exists()  # uploaded and not listed: deleted
    assert _durable_steps(faulty) == [10, 20]


def test_a_step_saved_again_while_its_upload_is_in_flight(faulty: str, tmp_path: Path) -> None:
    # The root's answer to "does it hold step 10" is known only after the copy in flight: the
    # second save of step 10 waits for it, then is skipped as any due save of a step the root
    # holds is (and the local files being uploaded are never rewritten under the upload).
    gate = FaultyFS.gate = Gate()
    with _mgr(faulty, tmp_path / "node") as mgr:
        try:
            assert mgr.save_async(10, _state(10))
            gate.wait_arrived()
            uploads = mgr._uploads
            assert uploads is not None
            drain = uploads.drain

            def open_then_drain(caller: Any) -> None:  # the save waits here, then plans
                gate.open()
                drain(caller)

            uploads.drain = open_then_drain  # type: ignore[method-assign]
            assert not mgr.save_async(10, _state(11))
        finally:
            gate.open()
        mgr.join()
        assert mgr.step_info(10).tiers == ("durable", "local")
        out = _target()
        mgr.restore(10, out)
        assert _equal(out, _state(10))
    assert _durable_steps(faulty) == [10]


def test_failed_upload_is_retried_and_keeps_the_local_step(
        faulty: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    node = tmp_path / "node"
    FaultyFS.fail_data = True
    with _mgr(faulty, node) as mgr:
        _upload_of_10_fails(mgr)
        assert mgr.all_steps() == [10] and mgr.step_info(10).tiers == ("local",)
        mgr.join()  # raised once
        # A fault that clears after one failed try: the retry commits.
        fails = iter([True])
        real = FaultyFS._open

        def once(self: FaultyFS, path: str, mode: str = "rb", **kw: Any) -> Any:
            FaultyFS.fail_data = next(fails, False)
            return real(self, path, mode, **kw)

        monkeypatch.setattr(FaultyFS, "_open", once)
        mgr.save_async(20, _state(20))
        mgr.join()
        assert mgr.step_info(20).tiers == ("durable", "local")
        assert mgr.step_info(10).tiers == ("local",)  # kept; superseded by step 20
    assert _durable_steps(faulty) == [20]


def test_restart_uploads_the_missing_durable_step(faulty: str, tmp_path: Path) -> None:
    node = tmp_path / "node"
    FaultyFS.fail_data = True
    with pytest.raises(AsyncSaveError), _mgr(faulty, node) as mgr:
        assert mgr._uploads is not None
        mgr._uploads.retry_s = 0.0
        mgr.save_async(5, _state(5))  # local only: never uploaded
        mgr.save_async(10, _state(10))
    FaultyFS.fail_data = False
    assert _durable_steps(faulty) == []
    with _mgr(faulty, node) as mgr:  # the constructor queues step 10's upload
        assert mgr.all_steps() == [5, 10] and mgr.step_info(10).tiers == ("local",)
        mgr.join()
        assert mgr.step_info(10).tiers == ("durable", "local")
        assert mgr.step_info(5).tiers == ("local",)
    assert _durable_steps(faulty) == [10]
    with ckptmgr.CheckpointManager(faulty, save_interval=10) as mgr:
        out = _target()
        mgr.restore(10, out)
        assert _equal(out, _state(10))


def test_a_restart_restores_the_local_step_while_its_upload_is_owed(faulty: str,
                                                                     tmp_path: Path) -> None:
    node = tmp_path / "node"
    FaultyFS.fail_data = True
    with pytest.raises(AsyncSaveError), _mgr(faulty, node) as mgr:
        assert mgr._uploads is not None
        mgr._uploads.retry_s = 0.0
        mgr.save_async(10, _state(10))
    FaultyFS.fail_data = False
    with _mgr(faulty, node) as mgr:  # the constructor queues step 10's upload
        out = _target()
        # A restore waits for the copies in flight (their retention changes the root), then
        # reads the local step.
        mgr.restore(10, out)
        assert _equal(out, _state(10))
        assert mgr.step_info(10).tiers == ("durable", "local")
    # An owed copy that fails every try does not fail the restore of the local step either:
    # the failure is raised by join (and the next due save), once.
    FaultyFS.fail_data = True
    with pytest.raises(AsyncSaveError), _mgr(faulty, node) as mgr:
        assert mgr._uploads is not None
        mgr._uploads.retry_s = 0.0
        mgr.save_async(20, _state(20))
    with _mgr(faulty, node) as mgr:
        assert mgr._uploads is not None
        mgr._uploads.retry_s = 0.0
        out = _target()
        mgr.restore(20, out)
        assert _equal(out, _state(20))
        with pytest.raises(AsyncSaveError) as err:
            mgr.join()
        assert err.value.step == 20
    FaultyFS.fail_data = False


def test_a_damaged_local_file_is_never_uploaded(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptmgr import uploader

    durable, node = str(tmp_path / "durable"), tmp_path / "node"
    real = uploader.mapped_state

    def damage_first(source: Any, step_dir: str) -> Any:
        data = next(p for p in sorted(Path(step_dir).iterdir()) if p.name.startswith("data-"))
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF  # after the local commit, before the upload reads it
        data.write_bytes(bytes(raw))
        return real(source, step_dir)

    monkeypatch.setattr(uploader, "mapped_state", damage_first)
    with _mgr(durable, node) as mgr:
        mgr.save_async(10, _state(10))
        with pytest.raises(AsyncSaveError) as err:
            mgr.join()
        assert err.value.step == 10
        assert isinstance(err.value.__cause__, CorruptCheckpointError)
        assert "checksum" in str(err.value)
        assert mgr.step_info(10).tiers == ("local",)
    assert _durable_steps(durable) == []


@pytest.mark.parametrize("change", ["removed", "emptied"])
def test_a_local_file_removed_or_emptied_after_listing_is_a_finding(
        change: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A data file removed or emptied between the listing and the upload's read is damage
    (CorruptCheckpointError: not tried again), not a read error, and never a bare ValueError."""
    from ckptmgr import uploader

    durable, node = str(tmp_path / "durable"), tmp_path / "node"
    real = uploader.mapped_state

    def change_first(source: Any, step_dir: str) -> Any:
        data = next(p for p in sorted(Path(step_dir).iterdir()) if p.name.startswith("data-"))
        if change == "removed":
            data.unlink()
        else:
            data.write_bytes(b"")
        return real(source, step_dir)

    monkeypatch.setattr(uploader, "mapped_state", change_first)
    with _mgr(durable, node) as mgr:
        err = _upload_of_10_fails(mgr)
        assert isinstance(err.__cause__, CorruptCheckpointError)
        assert ("missing" if change == "removed" else "changed size") in str(err.__cause__)
    assert _durable_steps(durable) == []


def test_a_read_error_fails_the_upload_and_keeps_the_step_owed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk's read error while the upload checks the local files (EIO, injected: no healthy
    file gives one) is an exception, where a read through the map would kill the process with
    SIGBUS: the upload is tried again (every try reads), fails, and the step stays owed, its
    files kept by local retention through later saves; once the disk reads again, the next due
    save's upload commits."""
    from ckptmgr import uploader

    durable, node = str(tmp_path / "durable"), tmp_path / "node"
    failing = [True]
    reads: list[int] = []
    real = uploader._pread

    def pread(fd: int, buf: memoryview, offset: int) -> int:
        if failing[0]:
            reads.append(offset)
            raise OSError(errno.EIO, "Input/output error (injected)")
        return real(fd, buf, offset)

    monkeypatch.setattr(uploader, "_pread", pread)
    with _mgr(durable, node) as mgr:
        err = _upload_of_10_fails(mgr)
        assert isinstance(err.__cause__, StorageError)
        assert "Input/output error" in str(err.__cause__)
        assert mgr._uploads is not None and len(reads) == mgr._uploads.tries  # each try read
        assert mgr.step_info(10).tiers == ("local",)
        for step in (15, 25):  # local only: each applies local retention
            mgr.save_async(step, _state(step))
            mgr.join()
        assert (node / "rank-0" / "10" / "commit.json").exists()  # kept: still owed
        failing[0] = False
        mgr.save_async(30, _state(30))
        mgr.join()
        assert mgr.step_info(30).tiers == ("durable", "local")
    assert _durable_steps(durable) == [30]


def test_close_waits_for_the_upload(faulty: str, tmp_path: Path) -> None:
    gate = FaultyFS.gate = Gate()
    mgr = _mgr(faulty, tmp_path / "node")
    mgr.save_async(10, _state(10))
    gate.wait_arrived()
    closer = threading.Thread(target=mgr.close)
    closer.start()
    gate.open()
    closer.join(60)
    assert not closer.is_alive()
    # Had close() not waited, the released lease would have fenced the upload's commit.
    assert _durable_steps(faulty) == [10]


# ----------------------------------------------------------------- two gloo ranks, S3, FSDP

def _full(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    """Every parameter and optimizer tensor, whole (gathered), hashed."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().full_tensor().contiguous().numpy().tobytes())
        for k, v in sorted(optim.state.get(p, {}).items()):
            t = v.full_tensor() if hasattr(v, "full_tensor") else v
            h.update(k.encode() + t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _app(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from ckptmgr.dcp import ModelOptimizerState

    return {"app": ModelOptimizerState(model, optim)}


def _train_and_upload(rank: int, world: int, durable: str, nodes: str) -> dict[str, Any]:
    model, optim = _fsdp(0)
    digests = {}
    with ckptmgr.CheckpointManager(durable, save_interval=10, local_interval=5,
                                   local_path=f"{nodes}/node{rank}") as mgr:
        for step in range(1, 21):
            x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            if mgr.save_async(step, _app(model, optim)):
                digests[step] = _full(model, optim)
        mgr.join()
        tiers = {s: mgr.step_info(s).tiers for s in mgr.all_steps()}
    with ckptmgr.CheckpointManager(durable, save_interval=10) as mgr:  # the durable tier only
        restored = {}
        for step in mgr.all_steps():
            model2, optim2 = _fsdp(1)
            ckptmgr.prime_optimizer(optim2)
            mgr.restore(step, _app(model2, optim2))
            restored[step] = _full(model2, optim2)
    return {"digests": digests, "tiers": tiers, "restored": restored}


def _restore_alone(rank: int, world: int, durable: str) -> dict[int, str]:
    out = {}
    with ckptmgr.CheckpointManager(durable, save_interval=10) as mgr:
        for step in mgr.all_steps():
            model, optim = _fsdp(2)
            ckptmgr.prime_optimizer(optim)
            mgr.restore(step, _app(model, optim))
            out[step] = _full(model, optim)
    return out


def test_two_ranks_fsdp_upload_to_s3_restores_at_any_world_size(s3_url: str,  # noqa: F811
                                                                tmp_path: Path) -> None:
    results = run_ranks(_train_and_upload, 2, s3_url, str(tmp_path), timeout_s=120)
    for r in results:
        assert r["tiers"] == {10: ("durable",), 15: ("local",), 20: ("durable", "local")}
        assert r["restored"] == {s: r["digests"][s] for s in (10, 20)}
    (alone,) = run_ranks(_restore_alone, 1, s3_url, timeout_s=120)  # another world size
    assert alone == {s: results[0]["digests"][s] for s in (10, 20)}
    assert os.path.isdir(tmp_path / "node1" / "rank-1" / "20")


def _interrupted(rank: int, world: int, durable: str, nodes: str, replicas: int,
                 wipe_rank: int | None) -> dict[str, Any]:
    """Save step 10 locally while its upload never runs (the uploader closed: as if the job
    died first); optionally wipe one rank's own step (a replaced node); restart."""
    os.environ["GROUP_RANK"] = str(rank)  # one node per rank (replicas go to other nodes)
    kw: dict[str, Any] = {"local_interval": 5, "local_replicas": replicas,
                          "local_path": f"{nodes}/node{rank}"}
    state = {"w": torch.full((32,), float(rank)), "extra": {"rank": rank}}
    with ckptmgr.CheckpointManager(durable, save_interval=10, **kw) as mgr:
        assert mgr._uploads is not None
        mgr._uploads.close()  # nothing is uploaded from now on
        mgr.save_async(10, state)
    torch.distributed.barrier()
    if rank == wipe_rank:
        import shutil

        shutil.rmtree(f"{nodes}/node{rank}/rank-{rank}/10")
    torch.distributed.barrier()
    with ckptmgr.CheckpointManager(durable, save_interval=10, **kw) as mgr:
        mgr.join()  # raises if the upload at construction failed
        return {"all": mgr.all_steps(), "tiers": mgr.step_info(10).tiers}


@pytest.mark.parametrize(("replicas", "wipe"), [(0, None), (1, 1)])
def test_two_ranks_restart_uploads_only_what_every_rank_holds(
        tmp_path: Path, replicas: int, wipe: int | None) -> None:
    durable = str(tmp_path / "durable")
    results = run_ranks(_interrupted, 2, durable, str(tmp_path), replicas, wipe, timeout_s=120)
    # Kept whole: uploaded at the restart. A replaced node's part held only as a replica: not
    # uploaded (an upload reads each rank's own copy), and no error either.
    want = ("local",) if wipe is not None else ("durable", "local")
    assert [r["tiers"] for r in results] == [want, want]
    assert _durable_steps(durable) == ([] if wipe is not None else [10])


def _stale_owed(rank: int, world: int, durable: str, nodes: str, phase: str) -> dict[str, Any]:
    """One phase of a job of two nodes (one rank each, ``local_replicas=1``) saving step 10
    locally while its upload never runs; ``resume``: a restart that only joins."""
    os.environ["GROUP_RANK"] = str(rank)
    kw: dict[str, Any] = {"local_interval": 5, "local_replicas": 1,
                          "local_path": f"{nodes}/node{rank}"}
    with ckptmgr.CheckpointManager(durable, save_interval=10, **kw) as mgr:
        if phase == "resume":
            failed = None
            try:
                mgr.join()
            except AsyncSaveError as e:
                failed = str(e)
            target = {"w": torch.zeros(32), "extra": {"rank": -1, "tag": ""}}
            step = mgr.restore_latest(target)
            mgr.join()
            return {"failed": failed, "restored": step, "tag": target["extra"].get("tag"),
                    "durable": step in mgr._durable.view.records}
        assert mgr._uploads is not None
        mgr._uploads.close()  # nothing is uploaded from now on (as if the job died first)
        mgr.save_async(10, {"w": torch.full((32,), float(rank)),
                            "extra": {"rank": rank, "tag": phase}})
    return {}


def test_a_stale_nodes_own_copy_of_another_save_is_not_uploaded(tmp_path: Path) -> None:
    # Node 1 comes back with its own copy of an older save of step 10 (run "a"); the whole save
    # is run "b"'s (node 0's own copy, and node 0's replica of node 1's part). The restart owes
    # step 10 to the durable tier: it must not fail (or upload) by reading the stale copy.
    import shutil

    durable, nodes = str(tmp_path / "durable"), tmp_path / "nodes"
    run_ranks(_stale_owed, 2, durable, str(nodes), "a", timeout_s=120)
    shutil.copytree(nodes / "node1", tmp_path / "stale")
    shutil.rmtree(nodes)
    shutil.rmtree(durable, ignore_errors=True)
    run_ranks(_stale_owed, 2, durable, str(nodes), "b", timeout_s=120)
    shutil.rmtree(nodes / "node1")
    shutil.copytree(tmp_path / "stale", nodes / "node1")
    res = run_ranks(_stale_owed, 2, durable, str(nodes), "resume", timeout_s=120)
    for r in res:
        assert r["failed"] is None, r
        assert r["restored"] == 10 and r["tag"] == "b", r
    # Not uploaded at the restart (node 1's own copy is another save): no durable step 10.
    assert _durable_steps(durable) == []


def _damaged_owed(rank: int, world: int, durable: str, nodes: str) -> dict[str, Any]:
    os.environ["GROUP_RANK"] = str(rank)
    kw: dict[str, Any] = {"local_interval": 5, "local_replicas": 1,
                          "local_path": f"{nodes}/node{rank}"}
    state = {"w": torch.full((32,), float(rank)), "extra": {"rank": rank}}
    with ckptmgr.CheckpointManager(durable, save_interval=10, **kw) as mgr:
        assert mgr._uploads is not None
        mgr._uploads.close()  # nothing is uploaded from now on (as if the job died first)
        mgr.save_async(10, state)
    torch.distributed.barrier()
    if rank == 1:  # a flipped byte in rank 1's own copy; its replica on node 0 is whole
        step_dir = Path(nodes, "node1", "rank-1", "10")
        data = next(p for p in step_dir.iterdir() if p.name.startswith("data-"))
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        data.write_bytes(bytes(raw))
    torch.distributed.barrier()
    with ckptmgr.CheckpointManager(durable, save_interval=10, **kw) as mgr:
        failed = None
        try:
            mgr.join()
        except AsyncSaveError as e:
            failed = str(e)
        target = {"w": torch.zeros(32), "extra": {"rank": -1}}
        step = mgr.restore_latest(target)
        return {"failed": failed, "restored": step, "exact": torch.equal(target["w"], state["w"])}


def test_a_damaged_own_copy_is_not_uploaded_at_restart(tmp_path: Path) -> None:
    # The restart owes step 10; rank 1's own copy is damaged: no failed upload is raised, and
    # the restore heals rank 1's part from its replica.
    durable = str(tmp_path / "durable")
    res = run_ranks(_damaged_owed, 2, durable, str(tmp_path / "nodes"), timeout_s=120)
    assert all(r["failed"] is None and r["restored"] == 10 and r["exact"] for r in res), res
    assert _durable_steps(durable) == []


def test_a_new_root_given_the_same_local_path_gets_no_upload_of_another_run(
        tmp_path: Path) -> None:
    # Run A's step 10 is owed to root A (its upload never ran). A new run with root B and the
    # same local_path must not write run A's checkpoint into root B.
    node = tmp_path / "node"
    with _mgr(str(tmp_path / "a"), node) as mgr:
        assert mgr._uploads is not None
        mgr._uploads.close()  # nothing is uploaded from now on (as if the job died first)
        assert mgr.save_async(10, _state(10))
    with _mgr(str(tmp_path / "b"), node) as mgr:
        mgr.join()
    assert _durable_steps(str(tmp_path / "b")) == []
    with _mgr(str(tmp_path / "a"), node) as mgr:  # run A's restart still uploads it
        mgr.join()
    assert _durable_steps(str(tmp_path / "a")) == [10]
