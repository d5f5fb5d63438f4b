"""``CheckpointManager``: the step-indexed API; it routes between the tiers and the save queue.

Collective calls (every rank of the group, same order): the constructor, ``save``, ``save_async``,
``restore``, ``join``, ``close``. Everything else is local and reads the view of committed steps
the ranks agreed on at construction and after each commit (the coordinator lists, then broadcasts).

What it routes between: the durable tier (:class:`~ckptmgr.durable.DurableTier`: the root, built
by the one recipe the writer process uses too), the node-local tier
(:class:`~ckptmgr.local_tier.LocalTier`), the single-in-flight queue and staging
(:mod:`ckptmgr._async`; :mod:`ckptmgr.writer_process` for ``async_mode="process"``), and
preemption (:mod:`ckptmgr.preemption`). The save half (``save``, ``save_async``, ``join``: decide,
prepare, write one save across the tiers) is its base class, :class:`~ckptmgr._save_path.SavePath`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ckptmgr._async import SaveQueue, Stager
from ckptmgr._dist import Comm, collective_timeout, make_group
from ckptmgr._exit import track
from ckptmgr._gc import gc_paused
from ckptmgr._save_on_close import LastGiven
from ckptmgr._save_path import SavePath
from ckptmgr._shm import ArenaSet
from ckptmgr.codec.layout import check_step
from ckptmgr.config import ManagerConfig, check_flag, load_config
from ckptmgr.dcp.state import check_state_dict
from ckptmgr.durable import DurableTier
from ckptmgr.events import Listeners, log_restore
from ckptmgr.info import SaveStats, StepInfo
from ckptmgr.initial import KeyMap, load_initial
from ckptmgr.local_tier import LocalTier, check_local_path
from ckptmgr.policy import best_step
from ckptmgr.preemption import PreemptionWatcher
from ckptmgr.uploader import Uploader
from ckptmgr.writer_process import WriterProcess

__all__ = ["CheckpointManager"]

log = logging.getLogger("ckptmgr")


class CheckpointManager(SavePath):
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
        local_replicas: int = 0,
        reuse_unchanged: bool = False,
    ) -> None:
        # Every argument but process_group and preemption_check is a setting declared once in
        # ckptmgr/config.py; tests/config/test_settings.py checks this signature against it.
        settings = dict(locals())
        for name in ("self", "process_group", "preemption_check"):
            del settings[name]
        self._closed = True  # until fully constructed, close() has nothing to release
        cfg = ManagerConfig.from_kwargs(**settings)
        self.config = cfg
        # Every argument is checked before the root is touched (DESIGN.md section 2).
        PreemptionWatcher.check_arguments(
            cfg.preemption.signals if cfg.preemption.enabled else (), preemption_check)
        check_local_path(cfg)
        self._durable = DurableTier.from_config(cfg)
        self._queue = SaveQueue()
        arenas = ArenaSet() if cfg.async_.mode == "process" else None  # shared staging memory
        self._stager = Stager(arenas)
        self._writer = WriterProcess(cfg, arenas) if arenas is not None else None
        self._preempt: PreemptionWatcher | None = None
        self._preempted_step: int | None = None
        self._grace_warned = False
        self._inflight_step: int | None = None
        self._last_stats: SaveStats | None = None
        self._events = Listeners()
        self._local: LocalTier | None = None  # the node-local tier
        self._uploads: Uploader | None = None  # durable copies made from local steps
        self._given = LastGiven(cfg.save_on_close)  # the newest step given and not saved
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
            self._durable.open(self._caller, take_over=cfg.take_over)
            self._local = LocalTier.open(  # its replica transfers: a group of their own
                cfg, self._caller, lambda: Comm(make_group(process_group, timeout), timeout),
                durable=self._durable.store.storage,  # other roots' local steps are left alone
            ) if cfg.local.path else None
            if self._local is not None and not cfg.read_only:
                # Durable copies of local steps, made in the background on a group of their own
                # (also with async_mode="process": the writer process reads the staged state it
                # is handed by reference, while an upload reads the local files, which this
                # process maps; its work is hashing and I/O, which release the GIL).
                self._uploads = Uploader(
                    self._durable, self._local,
                    Comm(group and make_group(process_group, timeout), timeout),
                    on_commit=self._uploaded)
                self._uploads.owed_at_start(self._caller)
            if self._writer is not None:  # started now: it is ready by the first save
                self._writer.ensure(self._caller, self._durable.lease)
            self._preempt = PreemptionWatcher(
                cfg.preemption.signals if cfg.preemption.enabled else (),
                file=cfg.preemption.file, check=preemption_check)
        except BaseException:
            self._release()  # a failed constructor leaves no handler, group, thread or lease
            raise
        self._closed = False
        track(self)  # its process groups end before the interpreter, should close() never come
        # The count is all_steps()'s (every tier); where they are is said only when not all of
        # them are ckptmgr steps of the root.
        view = self._durable.view
        local_only = len(set(self.all_steps()) - set(view.records) - view.foreign)
        where = [f"{n} {what}" for n, what in (
            (len(view.records), "in the root"),
            (local_only, f"only on the local tier {getattr(self._local, 'root', '')}"),
            (len(view.foreign), "written by plain DCP")) if n]
        log.info("CheckpointManager at %s: %d committed steps%s%s", self.path,
                 len(self.all_steps()),
                 f" ({', '.join(where)})" if local_only or view.foreign else "",
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
        return self._durable.url

    def all_steps(self) -> list[int]:
        """Restorable steps, ascending: ours and plain-DCP ones (the view agreed at
        construction and after each commit)."""
        view = self._durable.view
        return sorted({*view.records, *view.foreign,
                       *(self._local.steps if self._local is not None else ())})

    def latest_step(self) -> int | None:
        """The newest restorable step, or None."""
        return max(self.all_steps(), default=None)

    def best_step(self) -> int | None:
        """The best committed step by ``best_metric`` (None when unset or no step has it)."""
        ret = self.config.retention
        records = self._durable.view.records
        return None if ret.best_metric is None else best_step(
            [records[s] for s in sorted(records)], ret.best_metric, ret.best_mode)

    def step_info(self, step: int) -> StepInfo:
        """The manifest of committed ``step`` (reads it; local).

        Raises:
            CheckpointNotFoundError: ``step`` is not committed (lists the available ones).
            CorruptCheckpointError: the manifest does not parse or does not match.
        """
        step = check_step(step)
        self._durable.check_listed(step, self.all_steps())
        view = self._durable.view
        if step in view.foreign:
            return StepInfo.foreign(step)
        local = self._local is not None and step in self._local.steps
        if step not in view.records and self._local is not None:
            return self._local.step_info(step)
        info = StepInfo.from_manifest(self._durable.read_manifest(step))
        return replace(info, tiers=("durable", "local")) if local else info

    # ------------------------------------------------------------------------ collectives

    def close(self) -> None:
        """Wait for the save in flight and the durable copies being made from local steps
        (re-raising a failure), save the newest step given to save/save_async if it is newer
        than the newest committed one (``save_on_close``; not while an exception propagates),
        then release ckptmgr's process groups, staging memory, signal handlers and writer lease.
        Idempotent. Collective.

        Raises:
            AsyncSaveError: the save in flight, or a durable copy, failed.
            The errors of :meth:`save`, for the save on close.
        """
        failing = self._exit_failing
        self._close(failing=sys.exc_info()[0] is not None if failing is None else failing)

    def _close(self, *, failing: bool) -> None:
        if self._closed:
            return
        try:
            self.join()
            if self._given.given is not None:  # every rank has one alike (saves are collective)
                failing = self._caller.any(failing)  # an exception on one rank stops them all
            if not failing:
                self._save_on_close()
        finally:
            self._closed = True
            self._given.given = None
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
            self._durable.rescan(self._caller)
        step = self.latest_step()
        if step is None:
            return None
        self.restore(step, state_dict, **restore_kwargs)
        return step

    @gc_paused()
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
        comm = self._caller
        # Every background job ends first: the save in flight, its replica transfer (a rank
        # healing its part reads from the holders) and the durable copies being made from local
        # steps (their retention changes the root: the view read below is the one after them).
        # A failed durable copy does not fail the restore (the local step is read; join() and
        # the next due save raise it).
        self._join_saves()
        if self._local is not None:
            self._local.wait_replicas()
        if self._uploads is not None:
            self._uploads.drain(comm)
        comm.arrivals.begin("restore", step, "restore")
        if self.config.read_only and step not in self.all_steps():
            # A reader's view is from when it opened: the writer beside it may have committed
            # the step since. Look again (the new view is agreed like the first).
            self._durable.rescan(comm)
        # The view is the same everywhere: the coordinator checks, every rank raises alike.
        comm.on_coordinator(lambda: self._durable.check_listed(step, self.all_steps()))
        durable = self._durable.view.holds(step)  # alike everywhere
        nbytes = None if self._local is None else self._local.restore(  # the local tier first
            step, state_dict, comm, allow_partial=allow_partial, trusted=trusted,
            verify=self.config.verify, fallback=durable)
        read_local = nbytes is not None  # else the durable root is read below
        if nbytes is None:
            if not durable and self._local is not None:  # the local tier alone holds it
                raise self._local.unreadable(step, self.all_steps())
            nbytes = self._durable.restore(step, state_dict, comm, allow_partial=allow_partial,
                                           trusted=trusted)
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

    def _exit_unclosed(self) -> None:
        """(:mod:`ckptmgr._exit`, at interpreter exit) Let go of ckptmgr's process groups if
        close() never came, newest first (the background work ended: its threads are joined
        before exit hooks run). Local, no collective; the writer lease, writer process and files
        stay as an exit leaves them. From here on the manager is closed."""
        if self._closed:
            return
        busy = [what for what, running in (
            ("a save", self._queue.in_flight),
            ("a replica transfer", self._local is not None and self._local.transferring),
            ("a durable copy", self._uploads is not None and self._uploads.busy)) if running]
        if busy:
            # Only when the wait for those threads was interrupted (Ctrl-C): destroying a group
            # under a collective would fail it, or wait up to its timeout.
            log.warning("interpreter exit while %s still runs: ckptmgr's process groups are left "
                        "to the interpreter's teardown", " and ".join(busy))
            return
        self._closed = True
        self._end_groups()

    def _end_groups(self) -> None:
        """Destroy ckptmgr's process groups, newest first: the uploader's (its jobs ended), the
        replica transfer's (after the transfer in flight), the save worker's, the caller's."""
        if self._uploads is not None:
            self._uploads.close()
            self._uploads.comm.destroy()
        if self._local is not None:
            self._local.end_transfers()
        self._worker.destroy()
        self._caller.destroy()
        self._caller = self._worker = Comm(None)

    def _release(self) -> None:
        """Release the writer process, staging memory, process groups, signal handlers and the
        writer lease."""
        if self._writer is not None:
            self._writer.close()
        self._stager.release()
        if self._preempt is not None:
            self._preempt.uninstall()
        self._end_groups()  # close() waited for the uploader's jobs; none starts from now on
        if self._local is not None:
            self._local.close()  # its local writer lease
        self._durable.release()
