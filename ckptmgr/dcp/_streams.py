"""Parallel I/O streams of the DCP reader and writer: items cut into runs of about equal bytes,
each run on its own thread, the first failure stopping the others and reaching the caller."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

from ckptmgr._threads import finish_surely

__all__ = ["Stopped", "run_streams", "split_runs"]

T = TypeVar("T")


class Stopped(Exception):
    """Another stream failed: this one stops early (its error is not the one to report)."""


def split_runs(sizes: Sequence[int], num: int, min_bytes: int) -> list[int]:
    """Start indices that cut ``sizes`` (kept in order) into at most ``num`` runs of about equal
    bytes, each holding about ``min_bytes`` or more; never an empty run. ``[0]``: one run."""
    total = sum(sizes)
    num = max(1, min(num, len(sizes), total // max(1, min_bytes)))
    starts = [0]
    acc = 0
    for i, n in enumerate(sizes):
        if len(starts) < num and acc >= total * len(starts) / num and i > starts[-1]:
            starts.append(i)
        acc += n
    return starts


def run_streams(work: Callable[[int, threading.Event], T], num: int, *, name: str,
                always_thread: bool = False,
                thread_setup: Callable[[], object] | None = None,
                stop: threading.Event | None = None) -> list[T]:
    """Run ``work(i, stop)`` for each stream ``i`` in ``range(num)``; blocks until all have ended.

    One stream runs on the calling thread unless ``always_thread``; otherwise each stream gets a
    thread of its own named ``<name>-<i>``, on which ``thread_setup`` runs first (the calling
    thread is never passed to it: e.g. a raised nice value can never be undone there).

    A stream that fails sets ``stop``; the others should check it between pieces of work and raise
    :class:`Stopped`. The caller may pass ``stop`` to stop the streams from another thread. Every
    stream has ended before this returns or raises, so no thread is left touching the caller's
    buffers.

    Returns:
        The streams' results, in stream order.

    Raises:
        The first failure in time that is not :class:`Stopped` (a stream's own exception, as is).
    """
    assert num >= 1, "run_streams needs at least one stream"
    halt = stop if stop is not None else threading.Event()
    lock = threading.Lock()
    results: list[T | None] = [None] * num
    failures: list[BaseException] = []  # in the order they happened

    def stream(i: int, on_own_thread: bool) -> None:
        try:
            if on_own_thread and thread_setup is not None:
                thread_setup()
            results[i] = work(i, halt)
        except BaseException as e:
            halt.set()
            with lock:
                failures.append(e)

    if num == 1 and not always_thread:
        stream(0, False)
    else:
        # Each thread runs in a copy of the caller's context: the operation's retry budget
        # (ckptmgr.storage.retry_budget) and any other context variables follow the work.
        threads = [threading.Thread(target=contextvars.copy_context().run,
                                    args=(stream, i, True), name=f"{name}-{i}", daemon=True)
                   for i in range(num)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException:  # interrupted: the streams stop, and have ended when this raises
            halt.set()
            for t in threads:
                finish_surely(t.join)
            raise
    if failures:
        raise next((e for e in failures if not isinstance(e, Stopped)), failures[0])
    return cast("list[T]", results)  # every stream finished, so each slot holds its result
