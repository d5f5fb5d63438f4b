"""``CheckpointManager``: the step-indexed API over our DCP core; the only module wiring the others.

Collective calls (every rank of the group, same order): the constructor, ``save``, ``save_async``,
``restore``, ``join``, ``close``. Everything else is local and reads the view of committed steps
the ranks agreed on at construction and after each commit (the coordinator lists, then broadcasts).

What it wires: :mod:`ckptmgr.step_store` (every step directory), :mod:`ckptmgr.lease` (one writer
per root), :mod:`ckptmgr.dcp.checkpoint` (one trip into the DCP core per save or restore),
:mod:`ckptmgr._async` (the single-in-flight queue and staging), :mod:`ckptmgr.preemption` and
:mod:`ckptmgr.policy` (retention).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ckptmgr._async import SaveQueue, Stager
from ckptmgr._dist import Comm, collective_timeout, make_group
from ckptmgr._shm import ArenaSet
from ckptmgr.codec.layout import check_step
from ckptmgr.codec.manifest import check_metadata, check_metrics
from ckptmgr.config import ManagerConfig, check_flag, load_config
from ckptmgr.dcp.checkpoint import PreparedSave, SavePlanners, prepare_save
from ckptmgr.dcp.state import check_state_dict, flatten_state
from ckptmgr.errors import (
    AsyncSaveError,
    CkptmgrError,
    ConfigError,
    CorruptCheckpointError,
    SaveError,
    StorageError,
)
from ckptmgr.events import Listeners, log_restore, log_save
from ckptmgr.info import SaveStats, StepInfo
from ckptmgr.initial import KeyMap, load_initial
from ckptmgr.lease import Lease
from ckptmgr.policy import StepRecord, best_step
from ckptmgr.preemption import PreemptionWatcher, agree_preemption, warn_if_over_grace
from ckptmgr.step_store import CommitPlan, StepStore
from ckptmgr.storage import open_storage, retry_budget
from ckptmgr.tiers import LocalTier, durable_fits, restore_durable, save_durable
from ckptmgr.writer_process import (
    DurableJob,
    WriterProcess,
    retention_policy,
    stop_if_stuck,
    wire_items,
)

__all__ = ["CheckpointManager"]

log = logging.getLogger("ckptmgr")

_RESTORE_TRIES = 3  # a step overwritten while it is read is read again (old or new, never mixed)


@dataclass(frozen=True)
class _Request:
    """One save call's checked arguments."""

    step: int
    forced: bool
    metrics: dict[str, float]
    metadata: dict[str, Any]
    trusted: bool
    t_call: float


@dataclass(frozen=True)
class _Given:
    """The newest step given to save/save_async and not saved (``save_on_close``): the call, and
    the tensors' versions then, to tell whether the state changed since."""

    step: int
    first: int  # the oldest step given since the last one saved
    state_dict: Mapping[str, Any]
    request: _Request
    versions: tuple[Any, ...] | None  # None: the state could not be read at the call


def _versions(state_dict: Mapping[str, Any]) -> tuple[Any, ...]:
    """Where each tensor of the state lives and how often it was modified in place, and a digest
    of every other value (a data loader's position, random generator states, counters): equal
    before and after only if nothing was replaced or changed in between. Writes through
    ``tensor.data`` bypass the version counter and are not seen (docs/quickstart.md).

    Raises:
        ConfigError: flattening the state failed (a ``state_dict()`` of the user's raised).
    """
    from torch.distributed.tensor import DTensor

    try:
        flat = flatten_state(state_dict).flat
    except CkptmgrError:
        raise
    except Exception as e:
        raise ConfigError(f"reading the state (its state_dict() methods) failed: "
                          f"{type(e).__name__}: {e}") from e
    out: list[Any] = []
    for key, value in sorted(flat.items()):
        if isinstance(value, torch.Tensor):
            t = value.to_local() if isinstance(value, DTensor) else value
            try:
                where: Any = (t.data_ptr(), t.device)
            except (RuntimeError, NotImplementedError):
                # No storage (XLA): a module's state_dict() hands out new tensor objects at each
                # call, so only the version counter (shared with them) tells a change.
                where = str(t.device)
            out.append((key, where, t._version, tuple(t.shape), t.dtype))
        else:
            out.append((key, hashlib.blake2b(repr(value).encode(), digest_size=16).digest()))
    return tuple(out)


@dataclass(frozen=True)
class _Ready:
    """A save every rank agreed on: the prepared state and the coordinator's plan."""

    request: _Request
    prepared: PreparedSave
    plan: CommitPlan | None  # None: the local tier only
    local: bool = False  # also (first) to the local tier


@dataclass(frozen=True)
class _View:
    """The steps the ranks agreed on: ours (with what retention needs) and plain-DCP ones."""

    records: dict[int, StepRecord]
    foreign: frozenset[int]


class CheckpointManager:
    """Saves and restores a training state at integer steps under one root URL.

    Args: documented one by one in docs/configuration.md, with their YAML names. ``path`` is a
    root directory or URL (local, ``file://``, ``memory://``, ``gs://``, ``s3://``, any fsspec
    URL), a step a sub-directory named by its number; a step is due when ``step %
    save_interval == 0``; ``max_to_keep`` None or 0 keeps every step; ``max_pending_async`` > 1
    acts as 1 (one warning); after a preemption every rank saves that step, then exits with
    128 + signal (``exit_on_preemption=False``: returns, ``reached_preemption(step)`` is True);
    ``read_only``: no writer lease, saves refused; ``take_over``: take the lease from a live job.

    Raises:
        ConfigError: an invalid argument (names the field, value and rule), an unknown URL scheme,
            or a root that is a file.
        BackendNotInstalledError: the URL's fsspec backend is missing (says what to install).
        LeaseError: another live job writes this root (see ``read_only`` and ``take_over``).
    """

    def __init__(
        self,
        path: str,
        save_interval: int,
        max_to_keep: int | None = None,
        max_pending_async: int = 1,
        num_of_threads: int | None = None,
        process_group: Any = None,
        chkpt_on_preemption: bool = True,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_period: int | None = None,
        keep_time_interval: float | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        keep_best: int | None = None,
        overwrite: bool = False,
        backpressure: str = "block",
        verify: bool = True,
        preemption_signals: Any = (signal.SIGTERM,),
        preemption_grace_s: float = 30.0,
        exit_on_preemption: bool = True,
        preemption_file: str | None = None,
        preemption_check: Callable[[], bool] | None = None,
        planner: str = "auto",
        read_only: bool = False,
        take_over: bool = False,
        collective_timeout_s: float | None = None,
        local_path: str | None = None,
        local_interval: int | None = None,
        local_max_to_keep: int = 2,
        async_mode: str = "thread",
        save_on_close: bool = True,
    ) -> None:
        # Every argument but process_group and preemption_check is a setting declared once in
        # ckptmgr/config.py; tests/config/test_settings.py checks this signature against it.
        settings = dict(locals())
        for name in ("self", "process_group", "preemption_check"):
            del settings[name]
        self._closed = True  # until fully constructed, close() has nothing to release
        cfg = ManagerConfig.from_kwargs(**settings)
        self.config = cfg
        self._store = StepStore(open_storage(cfg.path, cfg.storage.options,
                                             writable=not cfg.read_only))
        ret = cfg.retention
        self._policy = retention_policy(cfg)
        self._needs_records = bool(ret.max_to_keep) and (
            ret.keep_time_interval is not None or ret.best_metric is not None)
        self._queue = SaveQueue()
        arenas = ArenaSet() if cfg.async_.mode == "process" else None  # shared staging memory
        self._stager = Stager(arenas)
        self._writer = WriterProcess(cfg, arenas) if arenas is not None else None
        self._planners = SavePlanners()
        self._lease: Lease | None = None
        self._preempt: PreemptionWatcher | None = None
        self._preempted_step: int | None = None
        self._grace_warned = False
        self._inflight_step: int | None = None
        self._last_stats: SaveStats | None = None
        self._events = Listeners()
        self._local: LocalTier | None = None  # the node-local tier (ckptmgr.tiers)
        self._given: _Given | None = None  # the newest step given and not saved (close())
        self._closing = False  # close() is saving the last step given
        self._exit_failing: bool | None = None  # set by __exit__: left by an exception
        # Two gloo groups of our own, each used by one thread only (two threads issuing
        # collectives on one group deadlock): the caller's thread, and the background writer.
        self._caller = self._worker = Comm(None)
        try:
            timeout = collective_timeout(cfg.collective_timeout_s)
            group = make_group(process_group, timeout)
            self._caller = Comm(group, timeout)
            self._worker = Comm(group and make_group(process_group, timeout), timeout)
            self._view = self._caller.on_coordinator(self._open_root)
            self._local = LocalTier.open(cfg, self._caller) if cfg.local.path else None
            if self._writer is not None:  # started now: it is ready by the first save
                self._writer.ensure(self._caller, self._lease)
            self._preempt = PreemptionWatcher(
                cfg.preemption.signals if cfg.preemption.enabled else (),
                file=cfg.preemption.file, check=preemption_check)
        except BaseException:
            self._release()  # a failed constructor leaves no handler, group, thread or lease
            raise
        self._closed = False
        # The count is all_steps()'s (every tier); where they are is said only when not all of
        # them are ckptmgr steps of the root.
        local_only = len(set(self.all_steps()) - set(self._view.records) - self._view.foreign)
        where = [f"{n} {what}" for n, what in (
            (len(self._view.records), "in the root"),
            (local_only, f"only on the local tier {getattr(self._local, 'root', '')}"),
            (len(self._view.foreign), "written by plain DCP")) if n]
        log.info("CheckpointManager at %s: %d committed steps%s%s", self.path,
                 len(self.all_steps()),
                 f" ({', '.join(where)})" if local_only or self._view.foreign else "",
                 " (read-only)" if cfg.read_only else "")

    @classmethod
    def from_config(cls, config: ManagerConfig | str | os.PathLike[str],
                    process_group: Any = None) -> CheckpointManager:
        """A manager from a :class:`ManagerConfig` or a YAML file (``CKPTMGR_PATH`` overrides the
        path). Collective, like the constructor."""
        cfg = load_config(config)
        return cls(process_group=process_group, **cfg.to_kwargs())

    # ----------------------------------------------------------------- introspection (local)

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.path!r}, "
                f"save_interval={self.config.save_interval}, steps={len(self.all_steps())})")

    @property
    def path(self) -> str:
        """The root URL, credentials redacted."""
        return self._store.url

    @property
    def last_save_stats(self) -> SaveStats | None:
        """Figures of the last completed save on this rank (None before the first)."""
        return self._last_stats

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due by the interval (local; no I/O)."""
        step = check_step(step)
        return (bool(step % self.config.save_interval == 0) or step == self._preempted_step
                or (self._local is not None and self._local.due(step)))

    def all_steps(self) -> list[int]:
        """Restorable steps, ascending: ours and plain-DCP ones (the view agreed at
        construction and after each commit)."""
        return sorted({*self._view.records, *self._view.foreign,
                       *(self._local.steps if self._local is not None else ())})

    def latest_step(self) -> int | None:
        """The newest restorable step, or None."""
        return max(self.all_steps(), default=None)

    def best_step(self) -> int | None:
        """The best committed step by ``best_metric`` (None when unset or no step has it)."""
        ret = self.config.retention
        records = self._view.records
        return None if ret.best_metric is None else best_step(
            [records[s] for s in sorted(records)], ret.best_metric, ret.best_mode)

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption was agreed, and its checkpoint taken, at ``step`` (local)."""
        return check_step(step) == self._preempted_step

    def step_info(self, step: int) -> StepInfo:
        """The manifest of committed ``step`` (reads it; local).

        Raises:
            CheckpointNotFoundError: ``step`` is not committed (lists the available ones).
            CorruptCheckpointError: the manifest does not parse or does not match.
        """
        step = check_step(step)
        self._require_listed(step)
        if step in self._view.foreign:
            return StepInfo.foreign(step)
        local = self._local is not None and step in self._local.steps
        if step not in self._view.records and self._local is not None:
            return self._local.step_info(step)
        info = StepInfo.from_manifest(self._store.read_manifest(step))
        return replace(info, tiers=("durable", "local")) if local else info

    # ------------------------------------------------------------------------ collectives

    def save(self, step: int, state_dict: Mapping[str, Any], force: bool = False, *,
             metrics: Mapping[str, float] | None = None, metadata: Mapping[str, Any] | None = None,
             trusted: bool = False) -> bool:
        """Save ``state_dict`` at ``step`` if due (or ``force``); blocks until committed.

        Collective. Waits for a save in flight first. Returns True when it saved; False when the
        step was not due, or is already in the root (a committed or foreign step: one warning).

        Raises:
            ConfigError: a bad step, flag, metrics, metadata or state dict; a read-only manager.
            CheckpointExistsError: a forced save of a step the root already holds (ours without
                ``overwrite``, or a directory ckptmgr did not write).
            UnsafeCheckpointError: the state holds objects that need pickle and not ``trusted``.
            SaveError: the save failed on some rank (``.failures``); nothing was committed.
            LeaseError: this manager lost the root's writer lease to another job.
            AsyncSaveError: the previous background save failed (raised once).
        """
        ready = self._start_save(step, state_dict, force, metrics, metadata, trusted,
                                 may_skip=False)
        if isinstance(ready, bool):
            return ready
        self._write(ready, ready.prepared.flat, self._caller, blocking_s=None)
        return True

    def save_async(self, step: int, state_dict: Mapping[str, Any], force: bool = False, *,
                   metrics: Mapping[str, float] | None = None,
                   metadata: Mapping[str, Any] | None = None, trusted: bool = False) -> bool:
        """Save ``state_dict`` at ``step`` in the background if due (or ``force``); True if queued.

        Collective. Captures the whole state before returning: tensors are copied into reused
        host buffers, Python values are deep-copied and every Stateful's ``state_dict()`` is
        called, so later changes never reach the checkpoint. A background worker then writes,
        commits and applies retention. With a save in flight it first waits for it
        (``backpressure="block"``) or returns False (``"skip"``; forced saves never skip).

        Raises:
            AsyncSaveError: the previous background save failed (raised once, on every rank).
            The errors of :meth:`save` that concern the inputs.
        """
        ready = self._start_save(step, state_dict, force, metrics, metadata, trusted,
                                 may_skip=True)
        if isinstance(ready, bool):
            return ready
        staged = self._stager.stage(ready.prepared.flat)
        wire = None if self._writer is None or ready.plan is None or ready.prepared.spmd else (
            wire_items(staged, self._stager, trusted=ready.request.trusted))  # for the writer
        blocking_s = time.perf_counter() - ready.request.t_call
        self._inflight_step = ready.request.step
        self._queue.submit(lambda: self._write(ready, staged, self._worker, blocking_s, wire),
                           name=f"ckptmgr-save-{ready.request.step}")
        return True

    def join(self) -> None:
        """Wait for the save in flight and its retention; re-raise its failure once.

        Raises:
            AsyncSaveError: the background save failed; its original error is ``__cause__``.
        """
        err = self._queue.wait()
        self._inflight_step = None
        if err is not None:
            raise AsyncSaveError(f"the background save of step {getattr(err, 'step', None)} "
                                 f"failed: {err}", step=getattr(err, "step", None),
                                 failures=getattr(err, "failures", None) or {}) from err

    def wait_until_finished(self) -> None:
        """Alias of :meth:`join`."""
        self.join()

    def close(self) -> None:
        """Wait for the save in flight (re-raising its failure), save the newest step given to
        save/save_async if it is newer than the newest committed one (``save_on_close``; not
        while an exception propagates), then release ckptmgr's process groups, staging memory,
        signal handlers and writer lease. Idempotent. Collective.

        Raises:
            AsyncSaveError: the save in flight failed.
            The errors of :meth:`save`, for the save on close.
        """
        failing = self._exit_failing
        self._close(failing=sys.exc_info()[0] is not None if failing is None else failing)

    def _close(self, *, failing: bool) -> None:
        if self._closed:
            return
        try:
            self.join()
            if self._given is not None:  # every rank has one alike (saves are collective)
                failing = self._caller.any(failing)  # an exception on one rank stops them all
            if not failing:
                self._save_on_close()
        finally:
            self._closed = True
            self._given = None
            self._release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        # Whether the block is left by an exception is what counts here, not sys.exc_info()
        # (which also shows an exception handled around the block).
        self._exit_failing = exc[0] is not None
        try:
            self.close()
        finally:
            self._exit_failing = None

    def _remember(self, req: _Request, state_dict: Mapping[str, Any]) -> None:
        """(caller thread) Note a step given but not saved, for close()."""
        if self.config.read_only or (self._given is not None and req.step < self._given.step):
            return
        first = self._given.first if self._given is not None else req.step
        versions: tuple[Any, ...] | None = ()
        if self.config.save_on_close:
            # Local, no collective (a step that is not due meets no other rank): a state that
            # cannot be read now is "changed" at close(), where the ranks agree on it.
            try:
                versions = _versions(state_dict)
            except CkptmgrError as e:
                log.debug("step %d: the state could not be read for save_on_close: %s",
                          req.step, e)
                versions = None
        self._given = _Given(req.step, first, state_dict, req, versions)

    def _save_on_close(self) -> None:
        """(collective) The final save of a normal close(), or the warning that it was not
        made: the newest given step, if newer than the newest committed one, unchanged since."""
        given, newest = self._given, self.latest_step()
        if given is None or (newest is not None and given.step <= newest):
            return
        steps = (f"step {given.step}" if given.first == given.step
                 else f"steps {given.first}-{given.step}")
        after = f"the newest committed step {newest}" if newest is not None else "no step"
        if not self.config.save_on_close:
            warnings.warn(
                f"close(): {steps} were given to save/save_async but not saved ({after} is "
                "committed) and save_on_close=False; pass force=True on the last step to save "
                "it", RuntimeWarning, stacklevel=3)
            return
        changed = self._caller.agree(  # on every rank alike: a collective either way
            lambda: given.versions is None or _versions(given.state_dict) != given.versions)
        if self._caller.any(changed):
            warnings.warn(
                f"close(): {steps} not saved: the state changed after save/save_async was "
                f"called with step {given.step} ({after} is committed), so it no longer is "
                "that step's state; pass force=True on the last step to save it",
                RuntimeWarning, stacklevel=3)
            return
        log.info("close(): saving step %d, newer than %s (save_on_close=True)", given.step,
                 after)
        r = given.request
        self._closing = True
        try:
            self.save(given.step, given.state_dict, force=True, metrics=r.metrics,
                      metadata=r.metadata, trusted=r.trusted)
        finally:
            self._closing = False

    def restore_latest(self, state_dict: Mapping[str, Any], **restore_kwargs: Any) -> int | None:
        """Restore the newest committed step (any tier) into ``state_dict`` in place and return
        it; None when the root holds no step (``state_dict`` untouched). Collective.

        ``restore_kwargs`` are :meth:`restore`'s (``allow_partial``, ``trusted``).

        Raises:
            The errors of :meth:`restore`.
        """
        self._check_open()
        check_state_dict(state_dict)
        if self.config.read_only:  # a reader's view is from when it opened: look again
            self._view = self._caller.on_coordinator(self._scan)
        step = self.latest_step()
        if step is None:
            return None
        self.restore(step, state_dict, **restore_kwargs)
        return step

    def restore(self, step: int, state_dict: Mapping[str, Any], *, allow_partial: bool = False,
                trusted: bool = False) -> None:
        """Load ``step`` into ``state_dict`` in place (resharding as needed). Collective.

        Loads exactly the keys of ``state_dict`` (a subset of the checkpoint is fine), from the
        local tier when every rank holds the step there, else from the durable one. A step
        overwritten while it is read is read again: the old or the new version, never a mix.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed (IncompleteCheckpointError when
                its directory exists but never committed).
            StateMismatchError: keys missing from the checkpoint (unless ``allow_partial``), shape
                or dtype mismatches, listed.
            CorruptCheckpointError: a size or checksum mismatch or unreadable metadata.
            UnsafeCheckpointError: a value needs pickle and not ``trusted`` (always, for a
                plain-DCP step), or a path escapes.
        """
        t_call = time.perf_counter()
        self._check_open()
        step = check_step(step)
        allow_partial = check_flag("allow_partial", allow_partial)
        trusted = check_flag("trusted", trusted)
        check_state_dict(state_dict)  # before any I/O: a list or None has no keys to load into
        self.join()
        comm, cfg = self._caller, self.config
        comm.arrivals.begin("restore", step, "restore")
        if self.config.read_only and step not in self.all_steps():
            # A reader's view is from when it opened: the writer beside it may have committed
            # the step since. Look again (the new view is agreed like the first).
            self._view = comm.on_coordinator(self._scan)
        comm.on_coordinator(lambda: self._require_listed(step))  # the view is the same everywhere
        durable = step in self._view.records or step in self._view.foreign  # alike everywhere
        nbytes = None if self._local is None else self._local.restore(  # the local tier first
            step, state_dict, comm, allow_partial=allow_partial, trusted=trusted,
            verify=cfg.verify, fallback=durable)
        read_local = nbytes is not None  # else the durable root is read below
        if nbytes is None:
            if not durable and self._local is not None and self._local.last_failure:
                raise CorruptCheckpointError(
                    f"step {step} is held only by the local tier ({self._local.root} on each "
                    f"rank) and cannot be read there: {self._local.last_failure}. "
                    + ("Part of the target state may hold its bytes; "
                       if self._local.last_failure_touched else "The target state was not "
                       "changed; ") + f"restore another step: {self.all_steps()}", step=step)
            comm.on_coordinator(lambda: self._require_listed(step, durable=True))
            nbytes = restore_durable(
                self._store, step, state_dict, comm, foreign=step in self._view.foreign,
                planner=cfg.planner, allow_partial=allow_partial, trusted=trusted,
                verify=cfg.verify)
        where = self._local.root if read_local and self._local is not None else self.path
        log_restore(step, where, nbytes, time.perf_counter() - t_call,
                    tier="local" if read_local else "durable")
        self._events.emit("on_restore_end", step, nbytes, time.perf_counter() - t_call)

    def load_initial(self, source: str | os.PathLike[str], state_dict: Mapping[str, Any], *,
                     key_map: KeyMap | None = None) -> bool:
        """Load a Hugging Face directory, ``.safetensors``/``.pt`` file or another root into
        ``state_dict`` in place while this root has no step (:mod:`ckptmgr.initial`).
        Collective. Returns False (logged, nothing loaded) once the run has its own steps."""
        self._check_open()
        if self.all_steps():
            log.info("load_initial ignored: %s already holds steps", self.path)
            return False
        load_initial(source, state_dict, key_map=key_map, comm=self._caller,
                     storage_options=self.config.storage.options, verify=self.config.verify)
        return True

    def add_listener(self, listener: Any) -> None:
        """Call ``listener``'s on_save_start/on_save_end/on_restore_end (ckptmgr.events)."""
        self._events.add(listener)

    # ------------------------------------------------------------------------- internals

    def _open_root(self) -> _View:
        """(coordinator) Take the writer lease unless read-only, then list the root."""
        if not self.config.read_only:
            self._lease = Lease(self._store.storage)
            self._lease.acquire(take_over=self.config.take_over)
            self._store.fence = self._lease.check  # every commit and removal checks it
        return self._scan()

    def _scan(self) -> _View:
        """(coordinator) List steps; read manifests only if a policy needs them."""
        scan = self._store.scan()
        read = self._needs_records or self.config.retention.best_metric is not None
        records = self._store.records(scan.committed, read_manifests=read)
        if scan.dcp_steps:
            log.warning("%s holds %d steps written by plain DCP (%s): listed, restorable with "
                        "trusted=True, never written or deleted by ckptmgr", self.path,
                        len(scan.dcp_steps), scan.dcp_steps[-5:])
        return _View(records, frozenset(scan.dcp_steps))

    def _start_save(self, step: Any, state_dict: Mapping[str, Any], force: Any, metrics: Any,
                    metadata: Any, trusted: Any, *, may_skip: bool) -> _Ready | bool:
        """(caller thread, collective) Check the call, agree on preemption and on whether to
        save; prepare the state and the coordinator's plan. A bool means: done, return it."""
        t_call = time.perf_counter()
        self._check_open()
        if self.config.read_only:
            raise ConfigError("this CheckpointManager is read_only=True: it cannot save; open "
                              "the root without read_only to write it")
        req = _Request(check_step(step), check_flag("force", force), check_metrics(metrics),
                       check_metadata(metadata), check_flag("trusted", trusted), t_call)
        check_state_dict(state_dict)  # also when the step is not due: the call is wrong anyway
        self._caller.arrivals.begin("save", req.step, "plan")
        # The save of close() is the last one anyway: it neither polls nor acts on preemption.
        signum = None if self._closing else agree_preemption(self._preempt, self._caller)
        if signum:
            return self._preemption_save(req, state_dict, signum)
        if not (req.forced or self.should_save(req.step)):
            # A step that is not due never blocks. A failure already known is raised now when
            # this process is alone; with several ranks only at due steps, where all ranks meet.
            self._remember(req, state_dict)
            if self._caller.world_size == 1 and self._queue.has_failed():
                self.join()
            return False
        # With "skip", every rank must take the same decision: skip if a save is in flight on any.
        if (may_skip and self.config.async_.backpressure == "skip" and not req.forced
                and self._caller.any(self._queue.in_flight)):
            log.info("skipping step %d: the save of step %s is still in flight", req.step,
                     self._inflight_step)
            self._remember(req, state_dict)
            return False
        restarted = self._writer is not None and self._writer.ensure(self._caller, self._lease)
        try:
            self.join()
        finally:  # a writer process that died may have committed before it could say so
            if restarted:
                self._view = self._caller.on_coordinator(self._scan)
        if self._given is not None and self._given.step <= req.step:
            self._given = None  # this save covers it
        return self._prepare(req, state_dict, on_exists="raise",
                             durable=req.forced or req.step % self.config.save_interval == 0,
                             local=self._local is not None and (req.forced or self._local.due(
                                 req.step)))

    def _prepare(self, req: _Request, state_dict: Mapping[str, Any], *,
                 on_exists: str, durable: bool = True, local: bool = False) -> _Ready | bool:
        """(caller thread, collective) Flatten and check the state; the coordinator plans."""
        comm = self._caller
        prepared = comm.agree(lambda: prepare_save(state_dict, planner=self.config.planner,
                                                   trusted=req.trusted), token=req.step)
        plan = comm.on_coordinator(lambda: self._begin_on_coordinator(
            req, prepared, on_exists)) if durable else None
        if local and plan is None and (durable or req.step in self._view.records
                                       or req.step in self._view.foreign):
            # The durable tier holds this step and keeps it: a new local copy would make two
            # versions of one step (which one a restore gets would depend on local retention).
            log.warning("skipping the local-tier save of step %d: the durable tier holds that "
                        "step%s", req.step, "" if durable else
                        "; save it with force=True and overwrite=True to replace it everywhere")
            local = False
        if plan is None and not local:
            return False
        self._events.emit("on_save_start", req.step)
        return _Ready(req, prepared, plan, local)

    def _begin_on_coordinator(self, req: _Request, prepared: PreparedSave,
                              on_exists: str) -> CommitPlan | None:
        try:
            # Planning reads the root (the lease, the step's directory): with the store gone
            # or hanging it fails within one retry budget, like the writes that follow.
            with retry_budget():
                self._check_lease()
                return self._store.begin_save(
                    req.step, forced=req.forced, overwrite=self.config.overwrite,
                    world_size=self._caller.world_size, metrics=req.metrics,
                    metadata=req.metadata, mesh=prepared.mesh, on_exists=on_exists)
        except StorageError as e:
            raise SaveError(f"save of step {req.step} to {self.path} failed: {e}", step=req.step,
                            failures={self._caller.rank: e}) from e

    def _preemption_save(self, req: _Request, state_dict: Mapping[str, Any],
                         signum: int) -> bool:
        """Every rank saves ``req.step`` now, waits for the commit, then exits (or returns)."""
        log.warning("preemption (signal %d) agreed at step %d: saving it before exiting",
                    signum, req.step)
        self._preempted_step = req.step
        self._given = None  # this is the last checkpoint: close() saves nothing after it
        try:
            with stop_if_stuck(self._writer, self.config.preemption.grace_s / 3):
                self.join()
        except AsyncSaveError as e:  # the last checkpoint matters more than the one before it
            log.error("the save before the preemption failed: %s", e)
        if self._local is not None:  # the fast tier first, the durable one if the grace allows
            local_ready = self._prepare(req, state_dict, on_exists="skip", durable=False,
                                        local=True)
            try:
                if isinstance(local_ready, _Ready):  # False: the durable tier holds the step
                    self._write(local_ready, local_ready.prepared.flat, self._caller, None)
            except SaveError as e:
                log.error("the local-tier preemption save failed: %s", e)
        fits = self._local is None or self._caller.on_coordinator(lambda: durable_fits(
            time.perf_counter() - req.t_call, self._last_stats, self.config.preemption.grace_s))
        ready = self._prepare(req, state_dict, on_exists="skip") if fits else True
        if isinstance(ready, _Ready):
            self._write(ready, ready.prepared.flat, self._caller, blocking_s=None)
        elif ready is False:
            log.warning("step %d is already in the root: it is the preemption checkpoint",
                        req.step)
        assert self._preempt is not None
        self._preempt.acknowledge()
        log.warning("preemption checkpoint of step %d committed in %.2f s", req.step,
                    time.perf_counter() - req.t_call)
        if self.config.preemption.exit_on_preemption:
            self.close()
            raise SystemExit(128 + signum)
        return True

    def _write(self, ready: _Ready, flat: dict[str, Any], comm: Comm,
               blocking_s: float | None, wire: dict[str, Any] | None = None) -> None:
        """(collective over ``comm``) Write, commit, apply retention, agree on the new steps.

        Runs on the caller's thread for ``save`` (``comm`` is the caller's) and on the worker
        thread for ``save_async`` (the worker's); ``wire``: the durable part runs in the writer.
        """
        plan, req = ready.plan, ready.request
        local_err = self._local.save(
            req.step, flat, comm, metrics=req.metrics, metadata=req.metadata,
            trusted=req.trusted, num_threads=self.config.async_.num_of_threads,
        ) if ready.local and self._local is not None else None
        if plan is None:
            if local_err is not None:
                raise local_err
            return
        try:
            if self._writer is not None and wire is not None:  # in the writer process
                out = self._writer.save(DurableJob(plan, req.trusted, wire, self._view.records,
                                                   sorted(self._view.foreign)),
                                        self._stager.take_retired())
            else:
                out = save_durable(
                    self._store, flat, plan, comm,
                    planner=self._planners.get(ready.prepared.spmd), trusted=req.trusted,
                    num_threads=self.config.async_.num_of_threads, fence=self._check_lease,
                    records=self._view.records, policy=self._policy,
                    dcp_steps=self._view.foreign)
        except BaseException:
            if plan.overwrite and ready.local and local_err is None and self._local is not None:
                # The local tier holds the new version, the root still the old one: one step,
                # two versions. The local copy goes (the failure is agreed on every rank).
                self._local.forget(req.step)
            raise
        self._view = _View(out.records, frozenset(out.dcp_steps))
        stats = SaveStats(
            step=plan.step,
            blocking_s=blocking_s if blocking_s is not None else time.perf_counter() - req.t_call,
            write_s=out.write_s, bytes=out.bytes_written, total_bytes=out.total_bytes,
            staging_bytes=self._stager.last_staged_bytes if blocking_s is not None else 0,
            pinned_bytes=self._stager.pinned_nbytes)
        self._last_stats = stats
        took = stats.blocking_s + (out.write_s if blocking_s is not None else 0.0)
        if self.config.preemption.enabled and not self._grace_warned:
            self._grace_warned = warn_if_over_grace(plan.step, took,
                                                    self.config.preemption.grace_s)
        log_save(stats, self.path)
        self._events.emit("on_save_end", stats)
        if local_err is not None:
            raise local_err

    def _check_lease(self) -> None:
        """(coordinator) Raise LeaseError unless this manager still holds the writer lease."""
        if self._lease is not None:
            self._lease.check()

    def _check_open(self) -> None:
        if self._closed:
            raise CkptmgrError("this CheckpointManager is closed; create a new one")

    def _release(self) -> None:
        """Release the writer process, staging memory, process groups, signal handlers and the
        writer lease."""
        if self._writer is not None:
            self._writer.close()
        self._stager.release()
        if self._preempt is not None:
            self._preempt.uninstall()
        for comm in (self._caller, self._worker):
            if comm.group is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group(comm.group)
                except Exception as e:  # a failed release must not mask the caller's error
                    log.debug("could not destroy ckptmgr group: %s", e)
        self._caller = self._worker = Comm(None)
        if self._local is not None:
            self._local.close()
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _require_listed(self, step: int, durable: bool = False) -> None:
        self._store.check_not_symlink(step)
        local = not durable and self._local is not None and step in self._local.steps
        if step not in self._view.records and step not in self._view.foreign and not local:
            raise self._store.not_found(step, self.all_steps())
