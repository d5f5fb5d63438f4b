"""Retries of storage calls: which failures are transient, and a bounded backoff loop.

Object-store clients already retry some failures themselves (botocore: up to 5 attempts on
5xx and throttling; gcsfs: 6 attempts on 5xx and connection errors). What escapes them (a reset in
the middle of a response body, a 5xx that outlasted the client's own attempts, a throttled listing
page) goes through :func:`call_with_retries`: exponential backoff with jitter, bounded both in
attempts and in total time, then the last error is re-raised for the caller to wrap in
``StorageError``.

One operation of the caller (a save, a restore, opening a root) may run many storage calls, on
several threads; under :func:`retry_budget` they all share one budget (:class:`RetryBudget`), a
deadline for the operation's failures: its first transient failure starts the clock, and from then
on every retry loop and every backoff sleep checks the time left, and no new request starts past
the deadline while the store is still failing (the call fails at once with
:class:`RetryBudgetSpent`, the last failure as its cause). A call that succeeds ends the outage:
a long save that met a short outage has its whole budget for the next one. The time spent in
failed attempts and in backoff sleeps, summed over every call of one outage, is bounded by the
same budget. A retry is not started when the time left is shorter than another attempt is
reckoned to take (the last failed one's, at most a quarter of the budget). So
a store that is gone for good fails a whole save (its writes, its commit, the clean-up of what it
wrote) within the budget plus at most the request in flight on each thread, not once per upload
part or once per call.

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
    "RetryBudget",
    "RetryBudgetSpent",
    "RetryPolicy",
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


def _now() -> float:
    """The clock of every deadline here (looked up at call time: tests replace it)."""
    return time.monotonic()


def _sleep(seconds: float) -> None:
    """Every backoff sleep here (looked up at call time: tests replace it)."""
    time.sleep(seconds)


class RetryBudgetSpent(TimeoutError):
    """An operation's storage call refused without a request: the store has been failing for
    the operation's whole retry budget (the last failure is the ``__cause__``)."""


class RetryBudget:
    """The retry budget of one operation, shared by all its storage calls (thread-safe).

    Two bounds, both ``seconds``: a deadline, started by the operation's first transient failure
    and cleared by the next call that succeeds (:meth:`failed`, :meth:`succeeded`); and the time
    spent in failed attempts and backoff sleeps, summed over every call (:meth:`spend`) until a
    call succeeds.

    Args:
        seconds: the budget.
        clock: the monotonic clock of the deadline (None: this module's; tests inject one).
    """

    def __init__(self, seconds: float, *, clock: Callable[[], float] | None = None) -> None:
        self.seconds = float(seconds)
        self._clock = clock
        self._spent = 0.0
        self._deadline: float | None = None
        self._attempt_s = 0.0  # how long the last failed attempt took
        self.last_error: BaseException | None = None
        self._lock = threading.Lock()

    def now(self) -> float:
        """The budget's clock."""
        return self._clock() if self._clock is not None else _now()

    def spend(self, seconds: float) -> None:
        """Count ``seconds`` of a failed attempt or a backoff sleep."""
        with self._lock:
            self._spent += max(0.0, seconds)

    def failed(self, err: BaseException, started: float, ended: float) -> None:
        """A call's attempt failed transiently (it ran from ``started`` to ``ended`` on the
        budget's clock): start the deadline unless an outage already started it."""
        with self._lock:
            self.last_error = err
            self._attempt_s = max(0.0, ended - started)
            if self._deadline is None:
                self._deadline = started + self.seconds

    def succeeded(self) -> None:
        """A call succeeded: the outage (if any) is over, the deadline and the summed time of
        failures are cleared (a long healthy save that meets isolated throttles keeps its whole
        budget for the next outage)."""
        if self._deadline is not None or self._spent:
            with self._lock:
                self._deadline = None
                self._spent = 0.0

    @property
    def deadline(self) -> float | None:
        """When the running outage exhausts the budget (budget clock); None while none runs."""
        with self._lock:
            return self._deadline

    @property
    def attempt_s(self) -> float:
        """How long another attempt is reckoned to take when deciding whether to start it: the
        last failed attempt's time (clients retry connection errors themselves, seconds per
        attempt), but at most a quarter of the budget, so that one slow time-out (s3fs reads
        time out after 60 s) never leaves a 90 s budget without a retry."""
        with self._lock:
            return min(self._attempt_s, self.seconds / 4)

    @property
    def remaining_s(self) -> float:
        """Seconds of the budget left: the smaller of the deadline's (when an outage runs) and
        the summed time's."""
        with self._lock:
            left = self.seconds - self._spent
            deadline = self._deadline
        if deadline is not None:
            left = min(left, deadline - self.now())
        return left

    def check(self, what: str) -> None:
        """Before a call: raise :class:`RetryBudgetSpent` when a running outage leaves less
        time than a failed attempt takes (the store is still failing: a new request would only
        end this operation later than its budget)."""
        if self.deadline is None or self.remaining_s > self.attempt_s:
            return
        raise RetryBudgetSpent(
            f"{what}: not attempted, the store has been failing for this operation's whole "
            f"retry budget of {self.seconds:g} s") from self.last_error


_BUDGET: contextvars.ContextVar[RetryBudget | None] = contextvars.ContextVar(
    "ckptmgr_retry_budget", default=None)


@contextmanager
def retry_budget(seconds: float | None = None) -> Iterator[RetryBudget]:
    """Make every storage call in this block (and in threads started through :func:`in_budget`)
    share one retry budget of ``seconds`` (None: :data:`DEFAULT_POLICY`'s ``total_timeout_s``,
    read now: the knob). An enclosing budget is kept: nested operations draw from the outer
    one."""
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
    """Run ``fn``; retry it on transient failures per ``policy`` and within the operation's
    budget (:func:`retry_budget`); re-raise the last failure.

    Args:
        fn: the whole operation; it must be safe to run again after a failure.
        what: names the operation and object in log lines (already redacted by the caller).
        policy: bounds and backoff (None: :data:`DEFAULT_POLICY` at call time).
        transient: which failures to retry.

    Raises:
        RetryBudgetSpent: before any request, when the operation's budget ran out in an outage
            that is still going on.
    """
    policy = policy or DEFAULT_POLICY
    budget = _BUDGET.get()
    clock = budget.now if budget is not None else _now
    if budget is not None:
        budget.check(what)
    start = clock()
    delays = policy.delays()
    attempt = 1
    while True:
        t_attempt = clock()
        try:
            result = fn()
        except Exception as e:
            if not transient(e):
                raise
            now = clock()
            left = float("inf")
            if budget is not None:
                budget.spend(now - t_attempt)
                budget.failed(e, t_attempt, now)
                # A retry that cannot fail again before the deadline is not started.
                left = budget.remaining_s - budget.attempt_s
            delay = next(delays, None)
            elapsed = now - start
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
            _sleep(delay)
            attempt += 1
        else:
            if budget is not None:
                budget.succeeded()
            return result
