"""A background save that starts writing while the caller still copies the state into staging
(ckptmgr._save_path.OVERLAP_STAGING, ckptmgr._async.StagingCopies): the checkpoint holds the
state as it was at the call, the writer reads no buffer before its copy landed (a gate holds one
copy back until the writer waits for it), a failed copy fails that save alone and says so once,
and the default overlaps in thread mode."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import pytest
import torch

from ckptmgr import AsyncSaveError, CheckpointManager, _async, _save_path
from ckptmgr._async import SaveQueue
from ckptmgr.dcp import writer as dcp_writer

MiB = 1 << 20


@pytest.fixture
def overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_save_path, "OVERLAP_STAGING", True)


def _state(seed: int) -> dict[str, Any]:
    """About 24 MiB in tensors of many sizes (over the copies' 8 MiB threshold: several copy
    threads), a bf16 one, an empty one and a Python value."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {f"t{i}": torch.randn(n, generator=g)
                          for i, n in enumerate([1, 7, 1000, 300_000, 2_500_000, 3_000_000, 5])}
    sd["bf16"] = torch.randn(64, 1000, generator=g).bfloat16()
    sd["empty"] = torch.empty(0)
    sd["epoch"] = seed
    return sd


def _zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_an_overlapped_save_holds_the_state_at_the_call(local_root: str, overlap: None) -> None:
    with CheckpointManager(local_root, save_interval=1, max_to_keep=2) as mgr:
        for step in range(3):
            state = _state(step)
            snapshot = {k: v.clone() if isinstance(v, torch.Tensor) else v
                        for k, v in state.items()}
            assert mgr.save_async(step, state)
            for v in state.values():  # the training step that follows, at once
                if isinstance(v, torch.Tensor) and v.numel():
                    v.mul_(-3).add_(1)
            mgr.join()
            out = _zeros_like(state)
            mgr.restore(step, out)
            assert _equal(out, snapshot), step
            stats = mgr.last_save_stats
            assert stats is not None and stats.blocking_s > 0
            assert stats.staging_bytes == sum(
                v.numel() * v.element_size() for v in snapshot.values()
                if isinstance(v, torch.Tensor))


def test_the_writer_waits_for_a_buffer_whose_copy_is_held_back(
        local_root: str, overlap: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy of the largest tensor waits until the writer waits for that buffer: a writer
    that read it early would write the previous save's bytes (the buffers are reused)."""
    with CheckpointManager(local_root, save_interval=1) as mgr:
        first = _state(1)
        mgr.save_async(1, first)
        mgr.join()
        second = _state(2)
        big = max((v for v in second.values() if isinstance(v, torch.Tensor)),
                  key=lambda t: t.numel())
        held: dict[str, Any] = {"dst": None, "writer_waited": threading.Event(),
                                "late": False}
        memmove, wait_ready = ctypes.memmove, _async.StagingCopies.wait_ready

        def slow_memmove(dst: int, src: int, n: int) -> Any:
            if src == big.data_ptr():  # the first piece of the big tensor's copy
                held["dst"] = dst
                held["late"] = not held["writer_waited"].wait(30)
            return memmove(dst, src, n)

        def spy_wait(self: Any, address: int) -> None:
            if held["dst"] is not None and address == held["dst"]:
                held["writer_waited"].set()
            wait_ready(self, address)

        monkeypatch.setattr(_async.ctypes, "memmove", slow_memmove)
        monkeypatch.setattr(_async.StagingCopies, "wait_ready", spy_wait)
        mgr.save_async(2, second)
        monkeypatch.setattr(_async.ctypes, "memmove", memmove)
        mgr.join()
        assert held["dst"] is not None and not held["late"]
        out = _zeros_like(second)
        mgr.restore(2, out)
        assert _equal(out, second)


@pytest.mark.parametrize("on", ["caller", "helper"])
@pytest.mark.parametrize("overlapped", [True, False])
def test_a_failed_copy_fails_that_save_once_and_the_next_one_commits(
        local_root: str, monkeypatch: pytest.MonkeyPatch, on: str, overlapped: bool) -> None:
    """On the caller's thread or on a copy helper (whose failure was lost before: the save
    committed a buffer whose copy had failed), with the overlap and without."""
    monkeypatch.setattr(_save_path, "OVERLAP_STAGING", overlapped)
    monkeypatch.setattr(_async, "_copy_workers", lambda: 2)  # one helper thread
    with CheckpointManager(local_root, save_interval=1) as mgr:
        state = _state(3)
        memmove = ctypes.memmove
        calls = {"n": 0}

        caller = threading.current_thread()
        failing_started = threading.Event()

        def failing_memmove(dst: int, src: int, n: int) -> Any:
            # Only the staging copies (ctypes.memmove is also the direct writer's); the other
            # copying thread waits until the failing one took a piece (it could take them all).
            me = threading.current_thread()
            helper = me.name.startswith("ckptmgr-stage")
            if (me is caller and on == "caller") or (helper and on == "helper"):
                calls["n"] += 1
                failing_started.set()
                if calls["n"] == 1:
                    raise MemoryError("injected: the copy into staging failed")
            elif me is caller or helper:
                failing_started.wait(10)
            return memmove(dst, src, n)

        monkeypatch.setattr(_async.ctypes, "memmove", failing_memmove)
        with pytest.raises(MemoryError, match="injected"):
            mgr.save_async(5, state)
        monkeypatch.setattr(_async.ctypes, "memmove", memmove)
        mgr.join()  # the job's own failure is this one's consequence: not raised again
        assert mgr.all_steps() == []
        assert mgr.save_async(6, state)
        mgr.join()
        assert mgr.all_steps() == [6]
        out = _zeros_like(state)
        mgr.restore(6, out)
        assert _equal(out, state)


def test_the_default_overlaps_in_thread_mode_only(local_root: str, tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Unforced, a thread-mode background save of CPU tensors stages behind its writer (round 6:
    on 2 CPUs too); with a writer process it stages first, as before."""
    first: list[int] = []  # saves that staged first (Stager.stage: the copies, then the job)
    real = _async.Stager.stage

    def spy(self: Any, flat: Any) -> Any:
        first.append(len(flat))
        return real(self, flat)

    monkeypatch.setattr(_async.Stager, "stage", spy)
    state = _state(3)
    with CheckpointManager(local_root, save_interval=1) as mgr:
        assert mgr.save_async(1, state)
        mgr.join()
        out = _zeros_like(state)
        mgr.restore(1, out)
        assert _equal(out, state)
    assert first == []
    with CheckpointManager(str(tmp_path / "proc"), save_interval=1, async_mode="process") as mgr:
        assert mgr.save_async(1, state)
        mgr.join()
        assert mgr.all_steps() == [1]
    assert first == [len(state)]


@pytest.mark.timeout(60)
def test_a_second_interrupt_while_save_async_waits_for_the_job_commits_nothing(
        local_root: str, overlap: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy is interrupted (Ctrl-C), then a second Ctrl-C lands while ``save_async`` waits for
    the job, and only then does the job read: the copies were aborted first, so the job fails
    instead of committing buffers whose copies never ran (before: the gate closed with the
    caller's wait and the job committed zeros; found by a review)."""
    state = {f"t{i}": torch.full((1 << 18,), float(i + 1)) for i in range(3)}
    with CheckpointManager(local_root, save_interval=1) as mgr:
        memmove, real_wait, real_qwait = ctypes.memmove, dcp_writer.wait_staged, SaveQueue.wait
        caller = threading.current_thread()
        calls = {"n": 0}
        job_may_read = threading.Event()

        def interrupted_memmove(dst: int, src: int, n: int) -> Any:
            if threading.current_thread() is caller and in_copies.is_set():
                calls["n"] += 1
                if calls["n"] == 2:
                    raise KeyboardInterrupt("first Ctrl-C, during the copies")
            return memmove(dst, src, n)

        in_copies = threading.Event()
        real_run = _async.StagingCopies.run

        def run(self: Any, *a: Any) -> None:
            in_copies.set()
            try:
                real_run(self, *a)
            finally:
                in_copies.clear()

        def late_wait_staged(t: torch.Tensor) -> None:
            assert job_may_read.wait(30)
            real_wait(t)

        def interrupted_queue_wait(self: Any) -> Any:
            if calls["n"] >= 2 and not job_may_read.is_set():  # after the first Ctrl-C
                job_may_read.set()
                raise KeyboardInterrupt("second Ctrl-C, while save_async waits for the job")
            return real_qwait(self)

        monkeypatch.setattr(_async.StagingCopies, "run", run)
        monkeypatch.setattr(_async.ctypes, "memmove", interrupted_memmove)
        monkeypatch.setattr(dcp_writer, "wait_staged", late_wait_staged)
        monkeypatch.setattr(SaveQueue, "wait", interrupted_queue_wait)
        with pytest.raises(KeyboardInterrupt, match="second"):
            mgr.save_async(5, state)
        monkeypatch.setattr(_async.ctypes, "memmove", memmove)
        monkeypatch.setattr(SaveQueue, "wait", real_qwait)
        with pytest.raises(AsyncSaveError, match="staging failed"):
            mgr.join()
        assert mgr.all_steps() == []
        assert mgr.save_async(6, state)
        mgr.join()
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        mgr.restore(6, out)
        assert _equal(out, state)


@pytest.mark.timeout(60)
def test_an_interrupt_before_the_copies_start_neither_hangs_nor_commits(
        local_root: str, overlap: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted as the copies are entered, before any ran: the job waiting for its first
    buffer is released with an error (before: it waited forever, and the process could not
    exit), and nothing is committed."""
    state = {f"t{i}": torch.full((1 << 18,), float(i + 1)) for i in range(3)}

    def interrupted_at_entry(self: Any, t_call: Any = None) -> None:
        raise KeyboardInterrupt("Ctrl-C as the copies are entered")

    with CheckpointManager(local_root, save_interval=1) as mgr:
        monkeypatch.setattr(_async.StagingCopies, "run", interrupted_at_entry)
        with pytest.raises(KeyboardInterrupt):
            mgr.save_async(5, state)
        monkeypatch.undo()
        mgr.join()  # the job's failure was this one's consequence: handed back once, above
        assert mgr.all_steps() == []
        assert not [t for t in threading.enumerate() if t.name.startswith("ckptmgr-save")]


@pytest.mark.timeout(60)
def test_an_interrupt_while_the_job_thread_starts_commits_nothing(
        local_root: str, overlap: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C lands in Thread.start()'s wait for the job's thread, which then begins only after
    save_async has raised: the job reads nothing and commits nothing (before: the caller took it
    for never started, closed the gate and left it running, and it committed the previous
    save's bytes from the staging buffers, with join() reporting success; found by a review)."""
    state = {f"t{i}": torch.full((1 << 18,), 1.0) for i in range(4)}
    release = threading.Event()
    real = SaveQueue.submit

    def interrupted(self: SaveQueue, job: Any, *, name: str) -> None:
        def late() -> None:
            release.wait()  # the job's thread runs once save_async has raised
            job()

        real(self, late, name=name)  # the thread is started...
        raise KeyboardInterrupt  # ...and Ctrl-C lands in start()'s wait for it

    with CheckpointManager(local_root, save_interval=1) as mgr:
        assert mgr.save_async(1, state)
        mgr.join()
        for v in state.values():
            v.fill_(2.0)
        monkeypatch.setattr(SaveQueue, "submit", interrupted)
        with pytest.raises(KeyboardInterrupt):
            mgr.save_async(2, state)
        monkeypatch.setattr(SaveQueue, "submit", real)
        release.set()
        mgr.join()  # the interrupted save was said once, by save_async
        assert mgr.all_steps() == [1]
        out = _zeros_like(state)
        mgr.restore(1, out)
        assert all(float(o.min()) == float(o.max()) == 1.0 for o in out.values())
        assert mgr.save_async(3, state)
        mgr.join()
        mgr.restore(3, out)
        assert _equal(out, state)


def test_a_job_thread_that_cannot_start_leaves_nothing_to_wait_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread the system cannot start: submit raises, and the queue holds no job (before, its
    next wait joined a thread that never started and raised RuntimeError)."""
    q = SaveQueue()

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(RuntimeError, match="can't start"):
        q.submit(lambda: None, name="never")
    monkeypatch.undo()
    assert not q.in_flight and q.wait() is None
