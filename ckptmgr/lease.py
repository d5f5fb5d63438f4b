"""The writer lease: one job writes a root at a time.

A manager that may save holds ``<root>/.ckptmgr-lease.json``: who holds it (host, pid, a random
id, the job id from the usual scheduler variables), since when, and until when. The coordinator's
training process acquires it in the constructor, renews it from a small daemon thread every third
of its time to live (so a long evaluation phase keeps it), checks it right before each commit
(fencing) and releases it in ``close()``.

Acquiring: an absent lease is created with an exclusive create; a lease whose holder is provably
dead (same host and the process gone, or this very process and the manager that held it gone) or
expired is taken over; any other live lease, a second live manager in this same process
included, is :class:`~ckptmgr.errors.LeaseError` unless ``take_over=True``. A take-over
writes the new lease, then reads it back: of two takers racing, the one that reads back
another's id has lost. Renewal reads the lease first and stops for good
when the id is not ours any more: that writer is fenced, and its next commit raises LeaseError
before anything of the attempt becomes visible. The read-then-write of renewal and take-over is
not a compare-and-swap: two writers can both believe they hold the lease for the moment between
one's write and the other's read; the check before every commit (and before removing leftovers)
closes that window for everything that matters (docs/storage.md).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from ckptmgr.errors import ConfigError, LeaseError, StorageError
from ckptmgr.storage import Storage, is_not_found

__all__ = ["DEFAULT_TTL_S", "LEASE_NAME", "Lease", "LeaseInfo", "writer_lease"]

log = logging.getLogger("ckptmgr")

LEASE_NAME = ".ckptmgr-lease.json"
DEFAULT_TTL_S = 60.0
"""Seconds a lease lives without renewal (``CKPTMGR_LEASE_TTL_S`` overrides): until then a job
restarted on another host after a SIGKILL gets LeaseError (naming when it expires)."""

_JOB_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "JOB_ID", "PBS_JOBID", "LSB_JOBID",
             "KUBERNETES_JOB_NAME", "HOSTNAME")
_MAX_LEASE_BYTES = 64 * 1024


def _job_id() -> str | None:
    for var in _JOB_VARS[:-1]:
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    return None


def _pid_namespace() -> str | None:
    """This process's PID namespace and boot (Linux), None elsewhere: equal only for processes
    whose pids can be compared."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{ns}@{f.read().strip()}"
    except OSError:
        return None


def ttl_from_env() -> float:
    """The lease time to live: ``CKPTMGR_LEASE_TTL_S`` if set (a number > 0), else 60 s."""
    raw = os.environ.get("CKPTMGR_LEASE_TTL_S")
    if raw is None:
        return DEFAULT_TTL_S
    try:
        ttl = float(raw)
    except ValueError:
        ttl = -1.0
    if not ttl > 0:
        raise ConfigError(f"CKPTMGR_LEASE_TTL_S must be a number of seconds > 0, got {raw!r}")
    return ttl


@dataclass(frozen=True)
class LeaseInfo:
    """The content of a lease file."""

    id: str
    host: str
    pid: int
    job: str | None
    since: float
    expires: float
    pid_ns: str | None = None  # the holder's PID namespace (Linux); None where unknown

    def describe(self) -> str:
        job = f", job {self.job}" if self.job else ""
        return (f"host {self.host}, pid {self.pid}{job}, held since "
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(self.since))}")

    def possible_pid(self) -> bool:
        """Whether a process of this system can have the holder's pid. Compared, never passed
        to the kernel: ``os.kill(-1, 0)`` signals every process, ``2**70`` overflows."""
        return 0 < self.pid <= _pid_max()

    def provably_dead(self) -> bool:
        """Same host and the process is gone; or this process, and the lease object that held
        it was released or garbage-collected (its manager is gone)."""
        if self.host != socket.gethostname():
            return False
        if self.pid_ns is None or self.pid_ns != _pid_namespace():
            # Containers can share a host name; a pid means something only in its namespace.
            return False
        if not self.possible_pid():
            return True  # no process of this namespace can hold it
        if self.pid == os.getpid():
            with _HELD_LOCK:
                return self.id not in _HELD
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    @classmethod
    def decode(cls, data: bytes) -> LeaseInfo | None:
        """The lease in ``data``, None if it does not parse (treated as expired): a JSON object
        whose ``id`` and ``host`` are strings, ``pid`` an integer (not a bool) and ``since``
        and ``expires`` finite numbers. A pid that no process can have (<= 0, or above the
        system's maximum) parses: that holder is dead where pids compare
        (:meth:`provably_dead`)."""
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):  # ValueError: JSON and UTF-8 errors alike
            return None
        if not isinstance(doc, dict):
            return None
        ident, host, pid = doc.get("id"), doc.get("host"), doc.get("pid")
        job, pid_ns = doc.get("job"), doc.get("pid_ns")
        since, expires = doc.get("since"), doc.get("expires")
        if not (isinstance(ident, str) and isinstance(host, str)
                and isinstance(pid, int) and not isinstance(pid, bool)
                and all(_is_time(t) for t in (since, expires))
                and (job is None or isinstance(job, str))
                and (pid_ns is None or isinstance(pid_ns, str))):
            return None
        assert isinstance(since, (int, float)) and isinstance(expires, (int, float))
        return cls(id=ident, host=host, pid=pid, job=job, since=float(since),
                   expires=float(expires), pid_ns=pid_ns)


_MAX_TIME = 1e11  # Unix seconds (the year 5138): beyond it a time is not one any clock wrote


def _is_time(value: Any) -> bool:
    """A finite number of Unix seconds within what clocks write (compared, so 2**70 and NaN
    are refused here, not by ``time.gmtime`` later)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and -_MAX_TIME <= value <= _MAX_TIME)


def _pid_max() -> int:
    """The largest pid this system gives (Linux: /proc/sys/kernel/pid_max; 2**22 otherwise,
    Linux's own ceiling)."""
    try:
        with open("/proc/sys/kernel/pid_max", "rb") as f:
            return int(f.read(32).strip())
    except (OSError, ValueError):
        return 1 << 22


# Leases held by this process, by lease id: a lease file naming this process whose id is not here
# belonged to a manager that is gone (dropped without close()), so it is taken over.
_HELD: weakref.WeakValueDictionary[str, Lease] = weakref.WeakValueDictionary()
_HELD_LOCK = threading.Lock()


class Lease:
    """The writer lease on one root (see the module docstring).

    Args:
        storage: the root.
        ttl_s: seconds the lease lives without renewal (None: ``CKPTMGR_LEASE_TTL_S`` or 60).
    """

    def __init__(self, storage: Storage, *, ttl_s: float | None = None) -> None:
        self.storage = storage
        self.ttl_s = ttl_from_env() if ttl_s is None else float(ttl_s)
        self.info: LeaseInfo | None = None
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._follower = False

    @classmethod
    def follow(cls, storage: Storage, info: LeaseInfo) -> Lease:
        """The lease ``info`` held by another process (the training process of a writer
        process), for :meth:`check` only: it is never renewed, taken or released here."""
        lease = cls(storage)
        lease.info = info
        lease._follower = True
        return lease

    # ------------------------------------------------------------------------------- acquire

    def acquire(self, *, take_over: bool = False) -> None:
        """Take the lease and start renewing it.

        Raises:
            LeaseError: another live writer holds it (names it, when it expires, the way out).
            StorageError: the lease could not be read or written.
        """
        current = self.read()
        if current is None:
            self.storage.makedirs("")
            mine = self._new_info()
            try:
                self.storage.write_bytes(LEASE_NAME, self._encode(mine), exclusive=True)
            except StorageError as e:
                if not isinstance(e.__cause__, FileExistsError):
                    raise
                current = self.read()  # someone created it between our read and our create
                if current is None:
                    # It exists but does not parse (torn by a crash, or edited by hand): it
                    # holds nobody, like an expired lease. Raising here would block every
                    # writer of the root until someone deleted the file by hand.
                    self._take_over_from(None, forced=take_over)
                    return
            else:
                self._hold(mine)
                return
        assert current is not None
        self._take_over_from(current, forced=take_over)

    def _take_over_from(self, current: LeaseInfo | None, *, forced: bool) -> None:
        now = time.time()
        if current is None:
            log.warning("%s: taking over an unreadable writer lease (%s does not parse)",
                        self.storage.url, LEASE_NAME)
            self._write_and_verify()
            return
        with _HELD_LOCK:
            local = _HELD.get(current.id)
        if current.expires <= now:
            log.info("%s: taking over the expired writer lease of %s", self.storage.url,
                     current.describe())
        elif current.provably_dead():
            if current.possible_pid():
                log.info("%s: taking over the writer lease of a process that is gone (%s)",
                         self.storage.url, current.describe())
            else:
                log.warning("%s: taking over a writer lease naming pid %d, which no process "
                            "on this host can have (%s)", self.storage.url, current.pid,
                            current.describe())
        elif forced:
            log.warning("%s: take_over=True: taking the live writer lease of %s; that writer "
                        "can no longer commit", self.storage.url, current.describe())
        else:
            left = current.expires - now
            who = ("another CheckpointManager in this process (close() it first)"
                   if local is not None else f"another job ({current.describe()})")
            raise LeaseError(
                f"{self.storage.url} is being written by {who}; its writer lease expires in "
                f"{left:.0f} s unless renewed. Only one writer per root: stop that one, open "
                "this root with read_only=True to read it, or pass take_over=True if you are "
                "sure it no longer writes")
        if local is not None and local is not self:
            local._mark_lost("taken over (take_over=True) by another CheckpointManager")
        self._write_and_verify()

    def _write_and_verify(self) -> None:
        """Write a new lease over whatever is there, then read it back: of two takers racing,
        the one that reads back another's id has lost."""
        mine = self._new_info()
        self.storage.write_bytes(LEASE_NAME, self._encode(mine))
        back = self.read()
        if back is None or back.id != mine.id:
            holder = back.describe() if back is not None else "unknown"
            raise LeaseError(f"{self.storage.url}: another writer took the lease at the same "
                             f"time ({holder}); only one job may write a root")
        self._hold(mine)

    def _hold(self, info: LeaseInfo) -> None:
        self.info = info
        with _HELD_LOCK:
            _HELD[info.id] = self
        self._thread = threading.Thread(target=_renew_loop, args=(weakref.ref(self), self._stop,
                                        self.ttl_s / 3), name="ckptmgr-lease", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------------------- hold, check

    def read(self) -> LeaseInfo | None:
        """The lease now in storage, None if there is none (or it does not parse)."""
        try:
            if self.storage.size(LEASE_NAME) > _MAX_LEASE_BYTES:
                return None
            data = self.storage.read_bytes(LEASE_NAME)
        except StorageError as e:
            if is_not_found(e):
                return None
            raise
        return LeaseInfo.decode(data)

    def renew(self) -> None:
        """Extend the lease if it is still ours, taking it back if it vanished (a wiped
        directory) or expired (an outage longer than its time to live) while nobody took it;
        mark it lost for good if another writer holds it. Never raises."""
        with self._lock:
            if self.info is None or self._lost is not None or self._follower:
                return
            try:
                self._extend(self.read())
            except Exception as e:  # a failed renewal must not kill the thread: retried soon
                log.warning("%s: could not renew the writer lease: %s", self.storage.url, e)

    def _extend(self, current: LeaseInfo | None) -> None:
        """(under ``_lock``, holder only) Write our lease with a new expiry over ``current``
        (what storage holds now), then read it back: another id there means we lost it."""
        assert self.info is not None
        if self._lost is not None:  # lost for good (another writer held it): never write again
            return
        if current is not None and current.id != self.info.id:
            self._mark_lost(f"the lease is now held by {current.describe()}")
            return
        info = LeaseInfo(**{**asdict(self.info), "expires": time.time() + self.ttl_s})
        if current is None:
            # Gone or unreadable: nobody holds it (a taker writes a lease that parses), so this
            # writer takes it back, with an exclusive create where it is absent.
            log.warning("%s: the writer lease file was gone or unreadable; nobody else holds "
                        "the root, so this writer takes its lease back", self.storage.url)
            self.storage.makedirs("")
            try:
                self.storage.write_bytes(LEASE_NAME, self._encode(info), exclusive=True)
            except StorageError as e:
                if not isinstance(e.__cause__, FileExistsError):
                    raise
                back = self.read()
                if back is not None:  # someone created a lease of their own meanwhile
                    self._extend(back)
                    return
                self.storage.write_bytes(LEASE_NAME, self._encode(info))
        else:
            if current.expires <= time.time():
                log.warning("%s: the writer lease expired %.0f s ago without renewal (storage "
                            "unreachable or the process stalled) and nobody took it; this writer "
                            "takes it back", self.storage.url, time.time() - current.expires)
            self.storage.write_bytes(LEASE_NAME, self._encode(info))
        back = self.read()
        if back is None or back.id != info.id:
            holder = back.describe() if back is not None else "nobody (it vanished again)"
            self._mark_lost(f"the lease is now held by {holder}")
            return
        self.info = info

    def check(self) -> None:
        """(before a commit or a deletion) Raise LeaseError unless this writer holds the lease
        now (read from storage) with time left. A holder whose lease vanished or expired while
        nobody took it takes it back here (logged); one whose lease another writer holds has
        lost it for good."""
        if self.info is None:
            raise LeaseError(f"{self.storage.url}: this writer holds no lease")
        if self._lost is None:
            try:
                current = self.read()
            except StorageError as e:
                raise LeaseError(f"{self.storage.url}: could not check the writer lease before "
                                 f"committing or deleting: {e}; nothing was changed") from e
            ours = current is not None and current.id == self.info.id
            if ours and current is not None and current.expires > time.time():
                return
            if self._follower:  # the training process renews or takes back; never this one
                if current is not None and not ours:
                    self._mark_lost(f"the lease is now held by {current.describe()}")
                else:
                    why = "expired" if current is not None else "is gone"
                    raise LeaseError(f"{self.storage.url}: the writer lease {why}; nothing was "
                                     "changed (the training process takes it back)")
            else:
                with self._lock:
                    try:
                        # Read again under the lock: the renewal thread may have seen another
                        # holder meanwhile, and a stale read must never be written over it.
                        self._extend(self.read())
                    except StorageError as e:
                        raise LeaseError(f"{self.storage.url}: could not take the writer lease "
                                         f"back: {e}; nothing was changed") from e
        if self._lost is not None:
            raise LeaseError(
                f"{self.storage.url}: this writer lost its lease ({self._lost}); nothing of this "
                "save became visible and it deletes nothing. Another job writes this root now: "
                "stop one of them")

    @property
    def held(self) -> bool:
        return self.info is not None and self._lost is None

    def _mark_lost(self, why: str) -> None:
        if self._lost is None:
            self._lost = why
            log.error("%s: writer lease lost: %s", self.storage.url, why)
        self._stop.set()

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still ours. Never raises."""
        self._stop.set()
        if self._follower:
            return
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            info, self.info = self.info, None
            if info is None:
                return
            with _HELD_LOCK:
                _HELD.pop(info.id, None)
            if self._lost is not None:
                return
            try:
                current = self.read()
                if current is not None and current.id == info.id:
                    self.storage.remove(LEASE_NAME)
            except Exception as e:  # the lease then expires by itself
                log.warning("%s: could not release the writer lease: %s", self.storage.url, e)

    # ------------------------------------------------------------------------------ encoding

    def _new_info(self) -> LeaseInfo:
        now = time.time()
        return LeaseInfo(id=secrets.token_hex(8), host=socket.gethostname(), pid=os.getpid(),
                         job=_job_id(), since=now, expires=now + self.ttl_s,
                         pid_ns=_pid_namespace())

    @staticmethod
    def _encode(info: LeaseInfo) -> bytes:
        return json.dumps(asdict(info), sort_keys=True).encode()


def _renew_loop(ref: Any, stop: threading.Event, every_s: float) -> None:
    # Holds the lease only weakly, so that a manager dropped without close() lets it go.
    while not stop.wait(every_s):
        lease = ref()
        if lease is None:
            return
        lease.renew()
        del lease


@contextmanager
def writer_lease(storage: Storage, *, take_over: bool = False) -> Iterator[Lease]:
    """Hold the writer lease of ``storage`` for the duration of a ``with`` block (the CLI's
    ``prune``, ``import`` and ``cp`` into a root).

    Raises:
        LeaseError: a live job writes this root.
    """
    lease = Lease(storage)
    lease.acquire(take_over=take_over)
    try:
        yield lease
    finally:
        lease.release()
