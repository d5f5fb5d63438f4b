"""Retries of storage calls: which failures are transient, and a bounded backoff loop.

Object-store clients already retry some failures themselves (botocore: up to 5 attempts on
5xx and throttling; gcsfs: 6 attempts on 5xx and connection errors). What escapes them (a reset in
the middle of a response body, a 5xx that outlasted the client's own attempts, a throttled listing
page) goes through :func:`call_with_retries`: exponential backoff with jitter, bounded both in
attempts and in total time, then the last error is re-raised for the caller to wrap in
``StorageError``.

One operation of the caller (a save, a restore, opening a root) may run many storage calls, on
several threads; under :func:`retry_budget` they all draw from one budget: the time spent in failed
attempts and in backoff sleeps, summed over every call, never exceeds it. Once it is spent, the
next transient failure is raised at once. So a store that is gone for good fails a whole save
within the budget, not once per upload part.

Only transient failures are retried: server errors (5xx), throttling (429, ``SlowDown``), request
timeouts and broken connections. "Not found", "exists", "forbidden" and bad requests never are.
"""

from __future__ import annotations

import contextvars
import errno
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "DEFAULT_POLICY",
    "RetryPolicy",
    "RetryBudget",
    "call_with_retries",
    "current_budget",
    "exception_chain",
    "in_budget",
    "is_transient",
    "retry_budget",
    "status_and_code",
]

log = logging.getLogger("ckptmgr.storage")
T = TypeVar("T")

_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "TooManyRequests",
    "TooManyRequestsException", "RequestLimitExceeded", "RequestThrottled",
    "RequestThrottledException", "ProvisionedThroughputExceededException", "InternalError",
    "ServiceUnavailable", "ServiceUnavailableException", "RequestTimeout",
    "RequestTimeoutException",
    "PriorRequestNotComplete", "BandwidthLimitExceeded", "EC2ThrottledException",
})
_TRANSIENT_ERRNOS = frozenset(
    getattr(errno, name) for name in (
        "ECONNRESET", "ECONNABORTED", "ECONNREFUSED", "EPIPE", "ETIMEDOUT", "EAGAIN", "EBUSY",
        "EREMOTEIO", "ENETRESET", "ENETUNREACH", "EHOSTUNREACH")
    if hasattr(errno, name))
# Client exception classes (aiohttp, botocore, urllib3, fsspec), matched by name so that this
# module imports none of them.
_TRANSIENT_CLASS_NAMES = frozenset({
    "ClientConnectionError", "ClientOSError", "ServerDisconnectedError", "ClientPayloadError",
    "ServerTimeoutError", "ConnectionTimeoutError", "SocketTimeoutError",
    "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
    "ResponseStreamingError", "IncompleteReadError", "HTTPClientError", "ProtocolError",
    "FSTimeoutError", "IncompleteRead", "RemoteDisconnected",
})
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
              NotADirectoryError)
_TRANSIENT_TEXT = ("reduce your request rate", "SlowDown", "Please try again")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long a transient storage failure is retried.

    Attempt ``n`` (1-based) that fails transiently sleeps ``d/2 + uniform(0, d/2)`` with
    ``d = min(max_backoff_s, initial_backoff_s * 2**(n-1))`` before the next attempt. No new attempt
    starts once ``max_attempts`` were made or when its sleep would end past ``total_timeout_s``
    after the first attempt started.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    total_timeout_s: float = 90.0

    def delays(self) -> Iterator[float]:
        """The jittered sleeps between attempts (``max_attempts - 1`` of them)."""
        for n in range(1, self.max_attempts):
            d = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (n - 1))
            yield d / 2 + random.uniform(0, d / 2)


DEFAULT_POLICY = RetryPolicy()


class RetryBudget:
    """Seconds of failed attempts and backoff that one operation may still spend (thread-safe)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self._spent = 0.0
        self._lock = threading.Lock()

    def spend(self, seconds: float) -> None:
        with self._lock:
            self._spent += max(0.0, seconds)

    @property
    def remaining_s(self) -> float:
        with self._lock:
            return self.seconds - self._spent


_BUDGET: contextvars.ContextVar[RetryBudget | None] = contextvars.ContextVar(
    "ckptmgr_retry_budget", default=None)


@contextmanager
def retry_budget(seconds: float | None = None) -> Iterator[RetryBudget]:
    """Make every storage call in this block (and in threads started through :func:`in_budget`)
    share one retry budget of ``seconds`` (None: :data:`DEFAULT_POLICY`'s total timeout). An
    enclosing budget is kept: nested operations draw from the outer one."""
    outer = _BUDGET.get()
    if outer is not None:
        yield outer
        return
    budget = RetryBudget(DEFAULT_POLICY.total_timeout_s if seconds is None else seconds)
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


def current_budget() -> RetryBudget | None:
    """The budget of the operation this thread works for, if any."""
    return _BUDGET.get()


def in_budget(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` bound to the caller's retry budget, to run on another thread (a pool worker)."""
    budget = _BUDGET.get()
    if budget is None:
        return fn

    def run(*args: object, **kwargs: object) -> T:
        token = _BUDGET.set(budget)
        try:
            return fn(*args, **kwargs)
        finally:
            _BUDGET.reset(token)

    return run


def exception_chain(err: BaseException) -> Iterator[BaseException]:
    """``err``, its cause (or context), that one's, ... (cycles and depth bounded)."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen and len(seen) < 16:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def status_and_code(e: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and the service's error code that ``e`` carries, where it has them."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        meta = response.get("ResponseMetadata") or {}
        error = response.get("Error") or {}
        status = meta.get("HTTPStatusCode")
        return (status if isinstance(status, int) else None), error.get("Code")
    for attr in ("status", "code", "status_code"):  # aiohttp, gcsfs HttpError, requests
        value = getattr(e, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
            return value, None
    return None, None


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` (or an exception in its cause chain) is worth retrying."""
    if isinstance(err, _PERMANENT):
        return False
    for e in exception_chain(err):
        if isinstance(e, _PERMANENT):
            return False
        status, code = status_and_code(e)
        if code in _TRANSIENT_CODES:
            return True
        if status is not None:
            return status in _TRANSIENT_STATUS
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if any(c.__name__ in _TRANSIENT_CLASS_NAMES for c in type(e).__mro__):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        if any(t in str(e) for t in _TRANSIENT_TEXT):
            return True
    return False


def call_with_retries(fn: Callable[[], T], *, what: str, policy: RetryPolicy | None = None,
                      transient: Callable[[BaseException], bool] = is_transient) -> T:
    """Run ``fn``; retry it on transient failures per ``policy``; re-raise the last failure.

    Args:
        fn: the whole operation; it must be safe to run again after a failure.
        what: names the operation and object in log lines (already redacted by the caller).
        policy: bounds and backoff (None: :data:`DEFAULT_POLICY` at call time).
        transient: which failures to retry.
    """
    policy = policy or DEFAULT_POLICY
    budget = _BUDGET.get()
    start = time.monotonic()
    delays = policy.delays()
    attempt = 1
    while True:
        t_attempt = time.monotonic()
        try:
            return fn()
        except Exception as e:
            if not transient(e):
                raise
            now = time.monotonic()
            if budget is not None:
                budget.spend(now - t_attempt)
            delay = next(delays, None)
            elapsed = now - start
            left = budget.remaining_s if budget is not None else float("inf")
            if delay is None or elapsed + delay > policy.total_timeout_s or delay > left:
                why = " (the operation's retry budget is spent)" if delay is not None and (
                    delay > left) else ""
                log.warning("%s: giving up after %d attempts in %.1f s%s: %s", what, attempt,
                            elapsed, why, type(e).__name__)
                raise
            log.info("%s: attempt %d failed (%s); retrying in %.2f s", what, attempt,
                     type(e).__name__, delay)
            if budget is not None:
                budget.spend(delay)
            time.sleep(delay)
            attempt += 1
