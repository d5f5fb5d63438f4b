"""The save queue and its staging buffers on their own (ckptmgr/_async.py, DESIGN.md section 6):
one job in flight, its failure handed back once, the worker surviving it; staged copies that later
mutation never reaches, in buffers reused while the structure is unchanged."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch

from ckptmgr._async import SaveQueue, Stager
from ckptmgr.dcp.shards import CpuShardedTensor, StagedShards

# A job held by a test that then fails must not hang the suite.
TIMEOUT_S = 60.0


class _HeldJob:
    """A job that waits for :meth:`release`; records the thread it ran on."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.started = threading.Event()
        self._release = threading.Event()
        self.error = error
        self.thread: threading.Thread | None = None

    def __call__(self) -> None:
        self.thread = threading.current_thread()
        self.started.set()
        assert self._release.wait(TIMEOUT_S), "the test never released the job"
        if self.error is not None:
            raise self.error

    def release(self) -> None:
        self._release.set()


# ------------------------------------------------------------------------------------ SaveQueue


def test_job_runs_on_a_named_worker_and_wait_joins_it() -> None:
    q = SaveQueue()
    assert not q.in_flight and q.wait() is None  # nothing submitted: nothing to wait for
    job = _HeldJob()
    q.submit(job, name="ckptmgr-save-7")
    assert job.started.wait(TIMEOUT_S)
    assert q.in_flight and not q.has_failed()
    assert job.thread is not threading.current_thread()
    assert job.thread is not None and job.thread.name == "ckptmgr-save-7"
    # not a daemon: interpreter exit waits for the commit instead of cutting it short
    assert not job.thread.daemon
    job.release()
    assert q.wait() is None
    assert not q.in_flight and not job.thread.is_alive()


def test_one_job_in_flight_at_a_time() -> None:
    q = SaveQueue()
    first = _HeldJob()
    q.submit(first, name="first")
    assert first.started.wait(TIMEOUT_S)
    second = _HeldJob()
    with pytest.raises(RuntimeError, match="already in flight"):
        q.submit(second, name="second")
    assert not second.started.is_set()  # refused: never started
    first.release()
    assert q.wait() is None
    second.release()  # once the first is joined, the next is accepted
    q.submit(second, name="second")
    assert q.wait() is None and second.started.is_set()


def test_failure_is_logged_kept_and_handed_back_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="ckptmgr")
    q = SaveQueue()
    boom = OSError("disk full (injected)")
    job = _HeldJob(error=boom)
    q.submit(job, name="failing")
    assert job.started.wait(TIMEOUT_S)
    assert not q.has_failed()  # still running: nothing to report yet
    job.release()
    assert job.thread is not None
    job.thread.join(TIMEOUT_S)
    assert q.has_failed() and not q.in_flight
    # logged when it happened: a process that exits without joining still reports it
    assert any("background save failed" in r.getMessage() and "disk full" in r.getMessage()
               for r in caplog.records)
    assert q.wait() is boom
    assert q.wait() is None and not q.has_failed()  # handed back once only


def test_worker_survives_a_failure_and_runs_the_next_job() -> None:
    q = SaveQueue()
    q.submit(lambda: (_ for _ in ()).throw(ValueError("first job fails")), name="a")
    err = q.wait()
    assert isinstance(err, ValueError) and "first job fails" in str(err)
    ran: list[str] = []
    q.submit(lambda: ran.append("second"), name="b")
    assert q.wait() is None and ran == ["second"]


def test_base_exceptions_are_kept_too() -> None:
    q = SaveQueue()

    def interrupted() -> None:
        raise KeyboardInterrupt

    q.submit(interrupted, name="interrupted")
    assert isinstance(q.wait(), KeyboardInterrupt)


# --------------------------------------------------------------------------------------- Stager


def test_staged_copy_is_independent_of_the_live_state() -> None:
    st = Stager()
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    extra: dict[str, Any] = {"epoch": 1, "hist": [1, 2]}
    staged = st.stage({"w": w, "extra": extra, "n": 5})
    w.add_(100)
    extra["hist"].append(3)
    assert torch.equal(staged["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert staged["extra"] == {"epoch": 1, "hist": [1, 2]} and staged["n"] == 5
    assert staged["w"].data_ptr() != w.data_ptr()
    assert st.nbytes == 12 * 4


def test_buffers_are_reused_while_shape_and_dtype_hold() -> None:
    st = Stager()
    first = st.stage({"w": torch.zeros(8), "v": torch.ones(2, dtype=torch.int64)})
    ptrs = {k: first[k].data_ptr() for k in ("w", "v")}
    second = st.stage({"w": torch.full((8,), 2.0), "v": torch.full((2,), 3, dtype=torch.int64)})
    assert {k: second[k].data_ptr() for k in ("w", "v")} == ptrs  # the same memory, refilled
    assert torch.equal(second["w"], torch.full((8,), 2.0))
    # a new shape or dtype gets a new buffer; a key that left the state drops its buffer
    third = st.stage({"w": torch.zeros(9), "v": torch.ones(2, dtype=torch.int32)})
    assert third["w"].shape == (9,) and third["v"].dtype == torch.int32
    assert st.nbytes == 9 * 4 + 2 * 4
    st.stage({"w": torch.zeros(9)})
    assert st.nbytes == 9 * 4
    st.release()
    assert st.nbytes == 0


def test_sharded_tensors_stage_one_copy_per_distinct_box() -> None:
    st = Stager()
    value = torch.arange(16.0).reshape(4, 4)
    # 2x2 mesh, split on dim 0 only: every box held by two replicas
    sharded = CpuShardedTensor(value, (2, 2), (0, None))
    staged = st.stage({"s": sharded})["s"]
    assert isinstance(staged, StagedShards)
    boxes = [(i.offsets, i.sizes) for i in staged.layout()]
    assert boxes == [((0, 0), (2, 4)), ((2, 0), (2, 4))]  # replicas not copied
    assert st.nbytes == 16 * 4
    got = torch.cat(staged.local_shards())
    assert torch.equal(got, value)
    ptrs = [t.data_ptr() for t in staged.local_shards()]
    again = st.stage({"s": CpuShardedTensor(value + 1, (2, 2), (0, None))})["s"]
    assert [t.data_ptr() for t in again.local_shards()] == ptrs  # reused
    assert torch.equal(torch.cat(again.local_shards()), value + 1)
    assert torch.equal(torch.cat(staged.local_shards()), value + 1)  # (the same buffers)
    # the key stops being sharded: its shard buffers go
    st.stage({"s": torch.zeros(2)})
    assert st.nbytes == 2 * 4
