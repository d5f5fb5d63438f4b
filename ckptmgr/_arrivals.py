"""Which rank reached which collective: a check-in on the process group's store, read only when a
collective fails, so that a timeout or a dead peer becomes an error naming the ranks that did not
arrive and the phase (``plan``, ``write``, ``commit``, ``restore``).

Call order (every rank of the group, the same calls in the same order):
1) ``begin(kind, step, phase)`` at the start of a save or restore (no I/O);
2) ``arrive(phase)`` right before each collective this rank enters (one store write);
   ``coordinator_done()`` (coordinator only) after its own part inside a collective (DCP's global
   plan, the commit), which the other ranks wait for inside that same collective;
3) ``error(exc)`` on a rank whose collective failed: reads the other ranks' check-ins and returns
   the SaveError/RestoreError to raise.

Cost: one ``set`` of one key per rank per collective, overwritten each time, so the store holds one
key per rank of the group whatever the number of saves; nothing is read unless a collective fails.
The group's store is found through a private torch name (guarded); without it the errors still
name the phase, but not the ranks.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ckptmgr.errors import CkptmgrError, RestoreError, SaveError

__all__ = ["Arrivals", "track"]

log = logging.getLogger("ckptmgr")

_KEY = "ckptmgr-arrival/"
# After a failure, ranks that are alive but a moment behind (a peer's death fails the collective
# of a rank that got there first) get this long to check in before they are named.
_GRACE_S = 2.0


def _group_store(group: Any) -> Any:
    """The store of ``group`` (its own prefix), or None where torch does not expose it."""
    from torch.distributed import distributed_c10d as c10d

    get = getattr(c10d, "_get_process_group_store", None)  # torch 2.9 - 2.13 at least
    try:
        return get(group) if get is not None else c10d._world.pg_map[group][1]
    except Exception as e:  # a torch without either: errors then name no ranks
        log.debug("no store for ckptmgr's group (%s): timeouts will not name ranks", e)
        return None


class Arrivals:
    """The check-ins of one rank on one group (or none without a group). Used by one thread."""

    def __init__(self, group: Any, *, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._store = _group_store(group) if group is not None and world_size > 1 else None
        self.kind: str | None = None  # "save" or "restore" while one runs
        self.step: int | None = None
        self.phase = "open"
        self._op = 0  # operations begun on this group (equal on every rank)
        self._k = 0  # collectives entered within the operation
        self._then: str | None = None  # the coordinator's part inside the current collective

    def begin(self, kind: str, step: int, phase: str) -> None:
        """(every rank) A save or restore of ``step`` starts, in ``phase``."""
        self._op += 1
        self._k = 0
        self.kind, self.step, self.phase, self._then = kind, step, phase, None

    def arrive(self, phase: str | None = None, then: str | None = None) -> None:
        """(every rank) This rank is about to enter a collective of ``phase`` (default: the
        current one); ``then``: the coordinator does that part inside it."""
        self._k += 1
        self.phase = phase or self.phase
        self._then = then
        self._put(2 * self._k, self.phase)

    def coordinator_done(self) -> None:
        """(coordinator) Its own part inside the current collective is done."""
        self._put(2 * self._k + 1, self._then or self.phase)

    def _put(self, mark: int, phase: str) -> None:
        if self._store is None:
            return
        try:
            self._store.set(f"{_KEY}{self.rank}", f"{self._op}:{mark}:{phase}")
        except Exception as e:  # the store is gone (its host died): the collective will say so
            log.debug("ckptmgr could not check in on the store: %s", e)

    def _seen(self, ranks: list[int]) -> dict[int, tuple[int, int, str] | None]:
        """Each rank's last check-in (operation, mark, phase), None if it never checked in."""
        assert self._store is not None
        out: dict[int, tuple[int, int, str] | None] = {}
        for r in ranks:
            key = f"{_KEY}{r}"
            if not self._store.check([key]):  # get() would wait for a missing key
                out[r] = None
                continue
            op, mark, phase = self._store.get(key).decode().split(":", 2)
            out[r] = (int(op), int(mark), phase)
        return out

    def missing(self) -> tuple[list[int], str, dict[int, str]]:
        """(after a failed collective) The ranks that did not reach the collective this rank was
        in, the phase, and where each of them was last seen."""
        phase = self.phase
        if self._store is None:
            return [], phase, {}
        me = (self._op, 2 * self._k)
        others = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + min(_GRACE_S, self.timeout_s)
        try:
            seen = self._seen(others)
            while True:
                behind = [r for r in others if seen[r] is None or seen[r][:2] < me]  # type: ignore[index]
                if not behind or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
                seen.update(self._seen(behind))
            if not behind and self._then is not None and self.rank != 0:
                done = seen[0]
                if done is not None and done[:2] < (self._op, 2 * self._k + 1):
                    behind, phase = [0], self._then
        except Exception as e:  # the store died with its host
            log.debug("ckptmgr could not read the check-ins: %s", e)
            return [], phase, {}
        where = {}
        for r in behind:
            s = seen[r]
            where[r] = ("never checked in" if s is None else f"last reached {s[2]!r} of this "
                        f"{self.kind or 'operation'}" if s[0] == self._op
                        else "not in this operation")
        return behind, phase, where

    def error(self, exc: BaseException) -> CkptmgrError:
        """(after a failed collective) The error to raise: SaveError or RestoreError naming the
        ranks that did not arrive and the phase; ``exc`` (the backend's error) is its cause."""
        missing, phase, where = self.missing()
        detail = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        if missing:
            seen = "; ".join(f"rank {r} {w}" for r, w in where.items())
            why = (f"ranks {missing} did not arrive within collective_timeout_s="
                   f"{self.timeout_s:g} s or died ({seen}); {detail}")
        else:
            why = f"a collective failed though every rank arrived: {detail}"
        what = f"{self.kind} of step {self.step}" if self.kind else "a collective of ckptmgr"
        msg = f"{what} failed in phase {phase!r} on rank {self.rank}: {why}"
        failures = {r: TimeoutError(f"rank {r} did not arrive in phase {phase!r} ({where[r]})")
                    for r in missing}
        if self.kind == "restore":
            return RestoreError(msg, step=self.step, phase=phase, missing_ranks=missing)
        return SaveError(msg, step=self.step, failures=failures, phase=phase,
                         missing_ranks=missing)


def track(obj: Any, arrivals: Arrivals | None, marks: dict[str, tuple[str, str | None]]) -> None:
    """Check in around methods of DCP's storage reader or writer ``obj`` (this instance only):
    ``marks`` maps a method name to (phase, coordinator part) for a method after which every rank
    enters a collective, or to ("", None) for the coordinator's own part (``coordinator_done``).
    The check-in happens even when the method raises: DCP enters the collective anyway."""
    if arrivals is None or arrivals._store is None:
        return
    for name, (phase, then) in marks.items():
        setattr(obj, name, _checked_in(getattr(obj, name), arrivals, phase, then))


def _checked_in(method: Any, arrivals: Arrivals, phase: str, then: str | None) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:
            if phase:
                arrivals.arrive(phase, then)
            else:
                arrivals.coordinator_done()

    return wrapper
