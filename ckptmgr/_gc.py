"""Python's cyclic garbage collector paused while a blocking call of the manager runs.

A save or restore allocates tens of thousands of short-lived objects (plans, items, metadata
columns) and frees them by reference counting when it returns. With the collector running, those
allocations trip its thresholds part-way and it scans every tracked object of the process, the
training job's own included: one full collection during a restore of 816 tensors took 160-270 ms
here, more than the metadata and planning together (docs/performance.md, "Garbage collection").
Paused for the call, nothing is scanned, and the objects the call freed leave the collector's
counts where they were. Only blocking calls pause it (the caller waits for them anyway); the
pause is the process's for as long as the call blocks (waits for a save in flight and collectives
included), so other threads allocate uncollected meanwhile. A background save's thread never
starts a pause, since the training loop runs while it writes. A child forked during a pause
starts with the collector as it was before the pause.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Iterator

__all__ = ["gc_paused"]

_LOCK = threading.Lock()
_depth = 0  # calls inside gc_paused now (threads and nesting together)
_resume = False  # whether the collector was enabled when the first of them began


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the collector for the block; the last block to end restores its earlier state."""
    global _depth, _resume
    with _LOCK:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()


def _reset_in_child() -> None:
    # The child runs none of the parent's calls: no pause of theirs ends in it.
    global _LOCK, _depth
    _LOCK = threading.Lock()
    if _depth:
        _depth = 0
        if _resume:
            gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
