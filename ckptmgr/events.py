"""Save and restore events for dashboards: listeners, and structured log records.

A listener is any object with some of these methods (missing ones are skipped); subclass
:class:`CheckpointListener` to get no-op defaults::

    class ToTensorBoard(ckptmgr.events.CheckpointListener):
        def on_save_end(self, stats):
            writer.add_scalar("ckpt/blocking_s", stats.blocking_s, stats.step)

    mgr.add_listener(ToTensorBoard())

Events, on every rank, in this order for one save:
1. ``on_save_start(step)``: the ranks agreed to save ``step`` (due, forced or preemption); the
   caller's thread, before the state is captured.
2. ``on_save_end(stats)``: ``step`` committed; ``stats`` is this rank's :class:`SaveStats`. For
   ``save_async`` this runs on the background writer thread: keep it short and thread-safe.
And ``on_restore_end(step, bytes_read, seconds)`` after a restore (or an initial load) finished.

A listener that raises never breaks a save or a restore: the first failure of each listener and
event is logged with its traceback at WARNING, later ones at DEBUG.

Each event is also a structured log record on the ``ckptmgr.events`` logger (INFO): the record
has ``ckptmgr_event`` (``"save_end"``, ``"restore_end"``) and ``ckptmgr_stats`` (a dict: for
saves :meth:`SaveStats.to_dict`, for restores ``step``, ``bytes_read``, ``seconds`` and ``tier``,
the tier this rank read: ``"local"`` or ``"durable"``), so a ``logging.Handler`` can forward them
too.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ckptmgr.info import SaveStats

__all__ = ["EVENTS", "CheckpointListener", "Listeners", "log_restore", "log_save"]

log = logging.getLogger("ckptmgr.events")

EVENTS = ("on_save_start", "on_save_end", "on_restore_end")


class CheckpointListener:
    """A listener with no-op defaults: override the events you want."""

    def on_save_start(self, step: int) -> None:
        """The ranks agreed to save ``step`` (caller's thread)."""

    def on_save_end(self, stats: SaveStats) -> None:
        """``stats.step`` committed (the writer thread for ``save_async``)."""

    def on_restore_end(self, step: int, bytes_read: int, seconds: float) -> None:
        """A restore (or initial load) of ``step`` finished on this rank."""


class Listeners:
    """The listeners of one manager; :meth:`emit` never raises."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._failed: set[tuple[int, str]] = set()
        self._lock = threading.Lock()  # emit runs on the caller's and the writer's threads

    def add(self, listener: Any) -> None:
        """Add ``listener``; it must have at least one of :data:`EVENTS`.

        Raises:
            TypeError: it has none of them.
        """
        if not any(callable(getattr(listener, e, None)) for e in EVENTS):
            raise TypeError(f"a listener needs one of the methods {', '.join(EVENTS)}; "
                            f"{type(listener).__name__} has none")
        with self._lock:
            self._items.append(listener)

    def remove(self, listener: Any) -> None:
        """Remove ``listener`` (no error when it is not there)."""
        with self._lock:
            self._items = [x for x in self._items if x is not listener]

    def emit(self, event: str, *args: Any) -> None:
        """Call ``event`` on every listener that has it; failures are logged, never raised."""
        with self._lock:
            items = list(self._items)
        for listener in items:
            fn = getattr(listener, event, None)
            if not callable(fn):
                continue
            try:
                fn(*args)
            except Exception:  # a dashboard must never break a checkpoint
                key = (id(listener), event)
                first = key not in self._failed
                self._failed.add(key)
                log.log(logging.WARNING if first else logging.DEBUG,
                        "listener %s.%s raised; the checkpoint is not affected%s",
                        type(listener).__name__, event,
                        "" if first else " (again)", exc_info=first)


def log_save(stats: SaveStats, url: str) -> None:
    """The structured INFO record of a committed save."""
    log.info("saved step %d to %s: blocked %.3f s, wrote %d bytes in %.3f s (%.1f MB/s, %s)",
             stats.step, url, stats.blocking_s, stats.total_bytes, stats.write_s,
             stats.throughput_bytes_per_s / 1e6, stats.tier,
             extra={"ckptmgr_event": "save_end", "ckptmgr_stats": stats.to_dict()})


def log_restore(step: int, url: str, bytes_read: int, seconds: float, *,
                tier: str = "durable") -> None:
    """The structured INFO record of a finished restore: ``url`` and ``tier`` are where this
    rank read the step (``"local"``: the node-local tier's directory, ``"durable"``: the root)."""
    log.info("restored step %d from the %s tier %s (%d bytes read on this rank in %.3f s)", step,
             tier, url, bytes_read, seconds,
             extra={"ckptmgr_event": "restore_end",
                    "ckptmgr_stats": {"step": step, "bytes_read": bytes_read,
                                      "seconds": seconds, "tier": tier}})
