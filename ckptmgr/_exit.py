"""Interpreter exit without ``close()``: ckptmgr's process groups end before the interpreter does.

A script may end without ``close()``: the save, replica transfer and durable copy in flight still
finish (their threads are not daemons, and CPython joins those before it runs any exit hook).
What such a script used to leave behind were ckptmgr's own gloo groups, each with worker threads
of torch's. A worker ends a collective by releasing its tensors, which can come after the caller
returned from it (a worker that lost the CPU for a moment); when the caller's Python objects of
those tensors are gone by then, releasing them takes the GIL. Once the interpreter finalizes,
CPython (before 3.14) ends a thread that takes the GIL with ``pthread_exit``, here inside a C++
destructor, and the process aborts ("terminate called without an active exception", exit
status -6/134) although the script's work succeeded.

So at exit, every manager not closed lets go of its groups
(:meth:`~ckptmgr.manager.CheckpointManager._exit_unclosed`): torch's destructor of a gloo group
joins its workers with the GIL released, so a late worker finishes while the interpreter is
whole. Local: no collective (the other ranks may be anywhere by now); nothing is raised (a
failure is logged).

Order: the hook is registered when this module is imported (with ``ckptmgr.manager``), so exit
hooks a script registers after importing ckptmgr run before it and may still use or close a
manager; managers are handled newest first, each one's groups in the reverse of their creation.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any

__all__ = ["track"]

log = logging.getLogger("ckptmgr")

_lock = threading.Lock()
_managers: list[weakref.ref[Any]] = []  # oldest first; a manager garbage collected drops out


def track(manager: Any) -> None:
    """Let go of ``manager``'s process groups at interpreter exit unless it was closed by then
    (it must have ``_exit_unclosed()``). Holds it weakly."""
    with _lock:
        _managers[:] = [r for r in _managers if r() is not None]
        _managers.append(weakref.ref(manager))


def _at_exit() -> None:
    with _lock:
        managers = [m for m in (r() for r in reversed(_managers)) if m is not None]
        _managers.clear()
    for manager in managers:
        try:
            manager._exit_unclosed()
        except Exception as e:  # never raised at exit: the next manager still ends its groups
            log.warning("interpreter exit: releasing the process groups of %r failed: %s: %s",
                        manager, type(e).__name__, e)


atexit.register(_at_exit)
