"""Joining the threads that write into a caller's buffers, whatever interrupts the join."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["finish_surely"]


def finish_surely(wait: Callable[[], object]) -> None:
    """Call ``wait`` (a join) until it returns, whatever interrupts it (a second Ctrl-C), then
    raise the first interruption: a thread that writes into buffers the caller hands back (or
    reuses) is never left running behind a raised exception."""
    caught: BaseException | None = None
    while True:
        try:
            wait()
            break
        except BaseException as e:
            caught = caught or e
    if caught is not None:
        raise caught
