"""Preemption: signal handlers that only set a flag, and the sources that can raise it.

Handlers (SIGTERM by default) never do I/O or collectives: they record the signal and chain the
handler that was installed before. The manager reads the flag at its next ``save``/``save_async``
call, OR-reduces it across ranks on the caller-thread group, and every rank then saves the same
step (DESIGN.md section 8). A file that appears (Kubernetes preStop, SLURM ``--signal`` scripts) or
a user callable can raise the same flag.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from ckptmgr.errors import ConfigError

__all__ = ["PreemptionWatcher", "agree_preemption", "warn_if_over_grace"]

log = logging.getLogger("ckptmgr")

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class PreemptionWatcher:
    """Watches the preemption sources of one manager.

    Args:
        signals: signals whose arrival means preemption (handlers installed now).
        file: a path whose existence means preemption, or None.
        check: a callable returning True on preemption, or None.

    Raises:
        ConfigError: signals were requested off the main thread (Python only allows handlers to
            be installed from it).
    """

    def __init__(self, signals: Sequence[signal.Signals] = (), *, file: str | None = None,
                 check: Callable[[], bool] | None = None) -> None:
        self.check_arguments(signals, check)
        self._file = file
        self._check = check
        self._signum = 0
        self._count = 0
        # Level sources (file, check) fire on a rising edge only: once when they read true, again
        # only after they have read false in between. A file left in place must not turn every
        # following step into a forced synchronous save.
        self._file_armed = True
        self._check_armed = True
        self._previous: dict[signal.Signals, _Handler] = {}
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    @staticmethod
    def check_arguments(signals: Sequence[signal.Signals], check: object) -> None:
        """Check what the constructor takes, before anything is installed or written (the
        manager calls this before it touches its root).

        Raises:
            ConfigError: ``check`` is not callable, or signals were requested off the main
                thread (Python only allows handlers to be installed from it).
        """
        if check is not None and not callable(check):
            raise ConfigError(f"preemption_check must be callable, got {check!r}")
        if signals and threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "chkpt_on_preemption=True installs signal handlers, which Python allows only on "
                "the main thread; construct the CheckpointManager on the main thread, or pass "
                "chkpt_on_preemption=False (no handlers) and detect preemption with "
                "preemption_file= or preemption_check=")

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only set a flag: a collective or I/O here could deadlock (Lightning #20825).
        if not self._signum:
            self._signum = signum
        self._count += 1
        previous = self._previous.get(signal.Signals(signum))
        # Python's own SIGINT handler raises KeyboardInterrupt, which would abort the very save
        # the signal asks for: a SIGINT listed as a preemption signal only sets the flag.
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    @property
    def signal_count(self) -> int:
        """How many preemption signals arrived."""
        return self._count

    def triggered(self) -> int:
        """The signal number that means preemption now (SIGTERM for a file or a callable), or 0.

        A file or a check fires once when it reads true; it fires again only after it has read
        false and then true again.
        """
        if self._signum:
            return self._signum
        fired = False
        if self._file is not None:
            present = os.path.exists(self._file)
            if present and self._file_armed:
                log.warning("preemption file %s appeared", self._file)
                fired = True
            self._file_armed = not present
        if self._check is not None:
            reported = bool(self._check())
            if reported and self._check_armed and not fired:
                log.warning("preemption_check reported a preemption")
                fired = True
            self._check_armed = not reported
        if fired:
            self._signum = int(signal.SIGTERM)
        return self._signum

    def acknowledge(self) -> None:
        """Mark the current preemption as handled (a later signal triggers again)."""
        self._signum = 0

    def uninstall(self) -> None:
        """Put back the handlers that were installed before, where ours are still in place."""
        if threading.current_thread() is not threading.main_thread():
            log.debug("not on the main thread: leaving preemption handlers installed")
            return
        for sig, previous in self._previous.items():
            try:
                current = signal.getsignal(sig)
                if getattr(current, "__self__", None) is self:
                    signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, OSError) as e:
                log.debug("could not restore the handler of %s: %s", sig, e)
        self._previous.clear()


def agree_preemption(watcher: PreemptionWatcher | None, comm: Any) -> int:
    """(collective over ``comm``, a :class:`~ckptmgr._dist.Comm`) The preemption signal any
    rank's ``watcher`` saw, else 0."""
    local = watcher.triggered() if watcher is not None else 0
    return local if comm.world_size == 1 else int(max(comm.all_gather(local)))


def warn_if_over_grace(step: int, took_s: float, grace_s: float) -> bool:
    """Warn (once per manager: the caller keeps the result) when a save took longer than the
    grace period a preemption leaves; whether it warned."""
    if took_s <= grace_s:
        return False
    log.warning("saving step %d took %.1f s, longer than preemption_grace_s=%.1f s: a "
                "preemption checkpoint may be killed before it commits; raise the grace period "
                "of your scheduler or make the state smaller", step, took_s, grace_s)
    return True
