"""Rank, world, broadcast and agreement over an optional gloo group; no-ops without one.

Every collective here is called by every rank of the group in the same order. ``agree`` and
``on_coordinator`` turn a failure on any rank into the same exception on every rank, so a bad input
on one rank never leaves the others waiting in a later collective.

Bounded: the group is made with the collective timeout (:func:`collective_timeout`), which also
bounds DCP's collectives on it; every collective here checks in first (:mod:`ckptmgr._arrivals`),
and one that fails or times out raises the SaveError/RestoreError naming the ranks that did not
arrive and the phase.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from ckptmgr._arrivals import Arrivals
from ckptmgr.errors import CkptmgrError, ConfigError, SaveError

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "Comm", "collective_timeout", "make_group", "portable"]

T = TypeVar("T")

log = logging.getLogger("ckptmgr")

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
"""Sized for real jobs: one rank's share of a large save to a slow object store fits in it."""
_ENV = "CKPTMGR_COLLECTIVE_TIMEOUT_S"


def collective_timeout(configured: float | None = None) -> timedelta:
    """Timeout of ckptmgr's own groups: ``configured`` (the manager's ``collective_timeout_s``),
    else ``CKPTMGR_COLLECTIVE_TIMEOUT_S`` seconds when set, else 600 s."""
    if configured is not None:
        return timedelta(seconds=configured)
    raw = os.environ.get(_ENV, str(DEFAULT_COLLECTIVE_TIMEOUT_S))
    try:
        seconds = float(raw)
    except ValueError:
        raise ConfigError(f"{_ENV} must be a number of seconds > 0, got {raw!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(f"{_ENV} must be a number of seconds > 0, got {raw!r}")
    return timedelta(seconds=seconds)


def make_group(process_group: Any, timeout: timedelta | None = None) -> Any:
    """A new gloo group over the ranks of ``process_group`` (or WORLD) whose collectives wait at
    most ``timeout`` (default :func:`collective_timeout`); None without a group.

    Collective over the members of ``process_group``.
    """
    timeout = timeout or collective_timeout()
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ConfigError(
                "process_group was given but torch.distributed is not initialized; call "
                "torch.distributed.init_process_group first or pass process_group=None")
        return None
    ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    if dist.get_rank() not in ranks:
        raise ConfigError(f"this rank ({dist.get_rank()}) is not a member of process_group")
    if len(ranks) == dist.get_world_size():
        # Every rank calls this, so use the globally counted group names: locally synchronized
        # groups are named from the number of live groups, and a manager created after another
        # was closed would reuse a name whose stale store keys make a late rank time out.
        return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout,
                          use_local_synchronization=True)


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a SaveError carrying its text (some backend errors don't)."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return CkptmgrError(f"{type(exc).__name__}: {exc}")


class Comm:
    """Collectives over ckptmgr's own group (or none).

    ``arrivals`` tracks the operation and phase (the manager calls ``arrivals.begin``); a collective
    here that fails or times out raises ``arrivals.error(...)``.
    """

    def __init__(self, group: Any, timeout: timedelta | None = None) -> None:
        self.group = group
        self._destroyed = False
        if group is None:
            self.rank, self.world_size = 0, 1
        else:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        self.is_coordinator = self.rank == 0
        self.arrivals = Arrivals(group, rank=self.rank, world_size=self.world_size,
                                 timeout_s=timeout.total_seconds() if timeout is not None
                                 else DEFAULT_COLLECTIVE_TIMEOUT_S)

    def destroy(self) -> None:
        """Destroy this Comm's own group and let go of it (a failure is logged: it must not mask
        the caller's error). Only for groups ckptmgr created; the Comm is unusable after.

        Letting go is what ends the group's threads: torch joins a gloo group's worker threads
        only when the last reference to the group goes (``destroy_process_group`` alone leaves
        them running), releasing the GIL meanwhile, so a worker still finishing the last
        collective (dropping tensors whose Python objects need the GIL) finishes here, while the
        interpreter is whole (:mod:`ckptmgr._exit`).
        """
        group, self.group = self.group, None
        if group is None:
            return
        self._destroyed = True
        if dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except Exception as e:
                log.debug("could not destroy ckptmgr group: %s", e)
        del group  # the last reference (the world's maps dropped theirs): the threads end here

    def _solo(self) -> bool:
        """Whether there is no group (one process).

        Raises:
            CkptmgrError: the group was destroyed (a collective on it now would hang or lie).
        """
        if self._destroyed:
            raise CkptmgrError("ckptmgr's process group was destroyed (its manager is closed); "
                               "create a new CheckpointManager")
        return self.group is None

    def _collective(self, fn: Callable[[], T]) -> T:
        self.arrivals.arrive()
        try:
            return fn()
        except Exception as e:
            raise self.arrivals.error(e) from e

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank."""
        if self._solo():
            return obj
        box = [obj]
        src = dist.get_global_rank(self.group, 0)
        self._collective(lambda: dist.broadcast_object_list(box, src=src, group=self.group))
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank."""
        if self._solo():
            return [obj]
        out: list[Any] = [None] * self.world_size
        self._collective(lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def barrier(self) -> None:
        """Wait for every rank."""
        if not self._solo():
            self._collective(lambda: dist.barrier(group=self.group))

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank."""
        return any(self.all_gather(bool(flag)))

    def _raise_first(self, errors: list[tuple[int, BaseException] | None]) -> None:
        failed = [e for e in errors if e is not None]
        if not failed:
            return
        rank, exc = failed[0]
        if rank == self.rank:
            raise exc
        if self.world_size > 1 and exc.args and isinstance(exc.args[0], str):
            exc.args = (f"[rank {rank}] {exc.args[0]}", *exc.args[1:])
        if isinstance(exc, SaveError):
            exc.failures.update({r: e for r, e in failed})
        raise exc

    def agree(self, fn: Callable[[], T], *, token: Any = None) -> T:
        """Run ``fn`` on every rank; if it failed on any rank, raise that rank's error everywhere.

        ``token``, when given, must be equal on every rank (e.g. the step being restored).
        """
        result: Any = None
        err: tuple[int, BaseException] | None = None
        try:
            result = fn()
        except Exception as e:
            err = (self.rank, portable(e))
        if self._solo():
            if err is not None:
                raise err[1]
            return result  # type: ignore[no-any-return]
        gathered = self.all_gather((err, token))
        self._raise_first([g[0] for g in gathered])
        tokens = [g[1] for g in gathered]
        if any(t != tokens[0] for t in tokens):
            raise ConfigError(
                f"ranks disagree: {dict(enumerate(tokens))}; every rank must make the same call")
        return result  # type: ignore[no-any-return]

    def on_coordinator(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the coordinator only; return its result (or raise its error) everywhere."""
        if self._solo():
            return fn()
        payload: Any = None
        if self.is_coordinator:
            try:
                payload = ("ok", fn())
            except Exception as e:
                payload = ("err", portable(e))
        payload = self.broadcast(payload)
        if payload[0] == "err":
            exc = payload[1]
            if not self.is_coordinator and self.world_size > 1 and exc.args and isinstance(
                    exc.args[0], str):
                exc.args = (f"[rank 0] {exc.args[0]}", *exc.args[1:])
            raise exc
        return payload[1]  # type: ignore[no-any-return]
