"""The retry budget: a store gone for good fails the whole save within it (a deadline for the save's
failures, its clean-up included), not once per call."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch
from _servers import S3_ERROR_BODIES, Fault, FaultProxy, MotoS3

from ckptmgr import (
    AsyncSaveError,
    CheckpointManager,
    SaveError,
)
from ckptmgr.storage import _retry


class _VirtualTime:
    """``time`` for the retry module: backoff sleeps advance a virtual clock instead of
    waiting; the clock is the real one plus every sleep so far (so the budget is checked on
    behaviour: how much retrying the code allowed itself, not how fast this machine is)."""

    def __init__(self) -> None:
        self._slept = 0.0
        self._lock = threading.Lock()
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        with self._lock:
            return time.monotonic() + self._slept

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self._slept += seconds
            self.sleeps.append(seconds)
        time.sleep(0.001)  # let other threads run


@pytest.fixture
def s3_proxy(moto_s3: MotoS3) -> Iterator[FaultProxy]:
    proxy = FaultProxy(moto_s3.endpoint_url)
    yield proxy
    proxy.stop()


BUDGET_S = 4.0


@pytest.mark.parametrize("how", ["503", "reset"])
def test_a_store_gone_mid_save_fails_it_within_the_budget(
        moto_s3: MotoS3, s3_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
        how: str) -> None:
    import s3fs

    # The budget is the knob (DEFAULT_POLICY.total_timeout_s); many attempts allowed per call,
    # so only the budget can stop the loops. The clients' own retries are off.
    monkeypatch.setattr(_retry, "DEFAULT_POLICY", _retry.RetryPolicy(
        max_attempts=10**6, initial_backoff_s=0.05, max_backoff_s=0.2, total_timeout_s=BUDGET_S))
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    clock = _VirtualTime()
    monkeypatch.setattr(_retry, "time", clock)
    opts = moto_s3.storage_options(endpoint_url=s3_proxy.url,
                                   config_kwargs={"retries": {"max_attempts": 0}})
    gone: list[float] = []  # when the store went away (virtual clock)

    def store_gone(method: str, path: str) -> bool:
        # From the first data write of step 2 on, every request fails: the store is gone.
        if not gone and method in ("PUT", "POST") and "/2/data-" in path:
            gone.append(clock.monotonic())
        return bool(gone)

    url = f"s3://ckpt-tests/{uuid.uuid4().hex}"
    state = {"w": torch.arange(3 * 2**20, dtype=torch.float32)}
    t0 = time.monotonic()
    with CheckpointManager(url, save_interval=1, storage_options=opts,
                           async_mode="thread") as mgr:
        mgr.save(1, state)
        # Every request answered with 503, or its connection reset (a server going down).
        fault = s3_proxy.add(Fault(store_gone, times=10**9, reset=how == "reset",
                                   status=503 if how == "503" else None,
                                   body=S3_ERROR_BODIES[503]))
        mgr.save_async(2, state)
        with pytest.raises(AsyncSaveError) as ei:
            mgr.join()
        failed_at = clock.monotonic()
        fault.times = 0  # the store is back: close() releases the lease
        assert isinstance(ei.value, SaveError)
        assert gone and fault.hits > 2
        # The whole save failed within the budget from the moment the store went away: its
        # writes, its commit and the clean-up of the failed attempt drew from one deadline.
        # (Slack: the requests in flight when it ran out, answered at once by the proxy.)
        assert failed_at - gone[0] <= BUDGET_S + 1.5, (failed_at - gone[0], clock.sleeps)
        assert mgr.all_steps() == [1]
    assert time.monotonic() - t0 < 3 * 60  # a hang guard only


def test_the_budget_is_a_deadline_started_by_the_first_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _VirtualTime()
    monkeypatch.setattr(_retry, "time", clock)
    policy = _retry.RetryPolicy(max_attempts=10**6, initial_backoff_s=0.5, max_backoff_s=1.0,
                                total_timeout_s=10**6)
    calls: list[str] = []

    def ok() -> str:
        calls.append("ok")
        return "ok"

    def down() -> None:
        calls.append("down")
        raise ConnectionResetError("reset")

    with _retry.retry_budget(5.0) as budget:
        clock.sleep(100.0)  # a long healthy save spends nothing of its budget
        assert _retry.call_with_retries(ok, what="put a", policy=policy) == "ok"
        assert budget.deadline is None
        start = clock.monotonic()
        with pytest.raises(ConnectionResetError):
            _retry.call_with_retries(down, what="put b", policy=policy)
        assert budget.deadline is not None and budget.deadline <= start + 5.0 + 0.5
        assert clock.monotonic() - start <= 5.0 + 0.5  # stopped by the deadline, not the count
        tries = calls.count("down")
        assert tries > 3
        # Past the deadline, while the store still fails: no new request at all.
        clock.sleep(max(0.0, budget.deadline - clock.monotonic()))
        with pytest.raises(_retry.RetryBudgetSpent) as ei:
            _retry.call_with_retries(down, what="delete c", policy=policy)
        assert calls.count("down") == tries and isinstance(ei.value.__cause__,
                                                          ConnectionResetError)
    with _retry.retry_budget(5.0) as budget:
        with pytest.raises(ConnectionResetError):
            _retry.call_with_retries(down, what="put d", policy=_retry.RetryPolicy(
                max_attempts=2, initial_backoff_s=0.5, max_backoff_s=1.0, total_timeout_s=60))
        assert budget.deadline is not None
        assert _retry.call_with_retries(ok, what="put e", policy=policy) == "ok"
        assert budget.deadline is None  # the outage is over: the next one gets a new deadline


def test_one_slow_time_out_still_gets_a_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first attempt that timed out after 50 s of a 90 s budget is retried (it succeeds): a
    retry is reckoned to take at most a quarter of the budget, not the slow attempt's time."""
    clock = _VirtualTime()
    monkeypatch.setattr(_retry, "time", clock)
    answers = iter([TimeoutError("read timed out"), "ok"])

    def slow_then_ok() -> str:
        answer = next(answers)
        if isinstance(answer, BaseException):
            clock.sleep(50.0)
            raise answer
        return answer

    policy = _retry.RetryPolicy(max_attempts=5, initial_backoff_s=0.5, max_backoff_s=1.0,
                                total_timeout_s=90.0)
    with _retry.retry_budget(90.0) as budget:
        assert _retry.call_with_retries(slow_then_ok, what="get a", policy=policy) == "ok"
        assert budget.deadline is None and budget.remaining_s == 90.0
