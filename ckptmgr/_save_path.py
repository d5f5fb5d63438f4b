"""The save half of :class:`~ckptmgr.manager.CheckpointManager`: decide, prepare and write one
save across the tiers.

A save call is checked, then every rank agrees on preemption and on whether to save (interval,
force, ``backpressure``); the state is prepared on every rank and the coordinator plans the
durable step (:meth:`~ckptmgr.durable.DurableTier.begin`). :meth:`SavePath._write` then writes
the local tier first (when due), then the durable tier, here or in the writer process, and records
the save's figures. ``save`` runs it on the caller's thread, ``save_async`` on the save queue's
worker (each with its own gloo group). A preemption saves the agreed step on every tier the
grace period allows, then ends the process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptmgr._async import SaveQueue, Stager, StagingCopies
from ckptmgr._dist import Comm
from ckptmgr._gc import gc_paused
from ckptmgr._save_on_close import LastGiven
from ckptmgr.codec.layout import check_step
from ckptmgr.codec.manifest import check_metadata, check_metrics
from ckptmgr.config import ManagerConfig, check_flag
from ckptmgr.dcp.checkpoint import PreparedSave, prepare_save
from ckptmgr.dcp.state import check_state_dict
from ckptmgr.dcp.tensor_bytes import close_gate, open_gate
from ckptmgr.durable import DurableOutcome, DurableTier, fits_in_grace
from ckptmgr.errors import AsyncSaveError, CkptmgrError, ConfigError, SaveError
from ckptmgr.events import Listeners, log_save
from ckptmgr.info import SaveStats
from ckptmgr.local_tier import UPLOAD_KEY, LocalTier
from ckptmgr.preemption import PreemptionWatcher, agree_preemption, warn_if_over_grace
from ckptmgr.step_store import CommitPlan
from ckptmgr.uploader import Uploader, UploadJob
from ckptmgr.writer_process import DurableJob, WriterProcess, stop_if_stuck, wire_items

__all__ = ["SavePath"]

log = logging.getLogger("ckptmgr")

OVERLAP_STAGING: bool = True
"""Background saves without a writer process start writing while the caller's thread still
copies the state into staging (:meth:`SavePath._submit`); False: the copies first, then the job.
On 2 CPUs, 1 GiB: committed 0.87x as long, compute lost to a training loop 0.84-1.13x (52
pairs, even), blocked 1.5x (0.08 -> 0.125 s) (docs/performance.md, "Round 6"). An experiment's
knob for ``benchmarks/`` and tests, not a user setting."""


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
class _Ready:
    """A save every rank agreed on: the prepared state and the coordinator's plan."""

    request: _Request
    prepared: PreparedSave
    plan: CommitPlan | None  # None: the local tier only, or the uploader plans (upload)
    local: bool = False  # also (first) to the local tier
    upload: bool = False  # the durable copy is made from the local step (ckptmgr.uploader)
    durable_due: bool = False  # due on the durable tier (recorded in the local step)


class SavePath:
    """The save half of :class:`~ckptmgr.manager.CheckpointManager` (``save``, ``save_async``,
    ``join``), its base class: the manager's constructor builds every part declared here."""

    config: ManagerConfig
    _durable: DurableTier
    _local: LocalTier | None
    _uploads: Uploader | None  # durable copies made from local steps (save_async, local tier)
    _queue: SaveQueue
    _stager: Stager
    _writer: WriterProcess | None
    _preempt: PreemptionWatcher | None
    _preempted_step: int | None
    _grace_warned: bool
    _inflight_step: int | None
    _last_stats: SaveStats | None
    _events: Listeners
    _given: LastGiven
    _closing: bool
    _caller: Comm
    _worker: Comm
    _closed: bool
    # The manager's public methods this half calls.
    close: Callable[[], None]
    latest_step: Callable[[], int | None]

    @property
    def last_save_stats(self) -> SaveStats | None:
        """Figures of the last completed save on this rank (None before the first)."""
        return self._last_stats

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due by the interval (local; no I/O)."""
        step = check_step(step)
        return (bool(step % self.config.save_interval == 0) or step == self._preempted_step
                or (self._local is not None and self._local.due(step)))

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption was agreed, and its checkpoint taken, at ``step`` (local)."""
        return check_step(step) == self._preempted_step

    @gc_paused()
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

    @gc_paused()
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
        self._submit(ready)
        return True

    def join(self) -> None:
        """Wait for the save in flight, its retention, its peer replica transfer and the durable
        copies being made from local steps; re-raise a failure once.

        Raises:
            AsyncSaveError: the background save, or a durable copy, failed (``step``: its step);
                the original error is ``__cause__``.
        """
        try:
            self._join_saves()
        finally:  # also when the save failed (agreed): nothing may run on after close()
            if self._local is not None:  # and for the peer replica transfer the save started
                self._local.wait_replicas()
            if self._uploads is not None:
                self._uploads.drain(self._caller)
        self._raise_upload_failure()

    def _raise_upload_failure(self) -> None:
        """(every rank alike: failures are adopted by agreement) Raise the first failed durable
        copy not raised yet."""
        failed = self._uploads.failure() if self._uploads is not None else None
        if failed is not None:
            step, err = failed
            raise AsyncSaveError(f"the background durable copy of step {step} failed: {err}",
                                 step=step, failures=getattr(err, "failures", None) or {}) from err

    def _join_saves(self) -> None:
        """Wait for the save queue's job (the local write, or the whole save without a local
        tier), not for the peer replica transfer it started (the next local save waits for that
        on its own thread, so ``save_async`` does not block on it) nor for durable copies in
        flight; re-raise its failure once."""
        err = self._queue.wait()
        inflight, self._inflight_step = self._inflight_step, None
        if err is not None:
            # An error without a step of its own (a LeaseError of the fence) names the step in
            # flight.
            step = getattr(err, "step", None)
            step = inflight if step is None else step
            raise AsyncSaveError(f"the background save of step {step} failed: {err}", step=step,
                                 failures=getattr(err, "failures", None) or {}) from err

    def wait_until_finished(self) -> None:
        """Alias of :meth:`join`."""
        self.join()

    def _check_open(self) -> None:
        if self._closed:
            raise CkptmgrError("this CheckpointManager is closed; create a new one")

    def _save_on_close(self) -> None:
        """(collective) The save of a normal close(): the newest step given and not saved, if
        ``save_on_close`` allows it (:class:`~ckptmgr._save_on_close.LastGiven`)."""
        given = self._given.to_save(self._caller, self.latest_step())
        if given is None:
            return
        r = given.request
        self._closing = True
        try:
            self.save(given.step, given.state_dict, force=True, metrics=r.metrics,
                      metadata=r.metadata, trusted=r.trusted)
        finally:
            self._closing = False

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
            self._given.remember(req.step, state_dict, req)
            if self._caller.world_size == 1 and self._queue.has_failed():
                self.join()
            return False
        # With "skip", every rank must take the same decision: skip if a save is in flight on any.
        if (may_skip and self.config.async_.backpressure == "skip" and not req.forced
                and self._caller.any(self._queue.in_flight)):
            log.info("skipping step %d: the save of step %s is still in flight", req.step,
                     self._inflight_step)
            self._given.remember(req.step, state_dict, req)
            return False
        durable = req.forced or req.step % self.config.save_interval == 0
        local = self._local is not None and (req.forced or self._local.due(req.step))
        # A step due on both tiers by their intervals, saved in the background: its durable copy
        # is made from the local files by the uploader; the next save does not wait for it.
        upload = (may_skip and local and durable and not req.forced
                  and self._uploads is not None)
        restarted = self._writer is not None and self._writer.ensure(self._caller,
                                                                     self._durable.lease)
        try:
            self._join_saves()
            if local and self._local is not None and self._local.skips(req.step, self._caller):
                # Another root's local step holds this step number (agreed, and stable now
                # that no save is in flight): the durable tier alone, written directly.
                local = upload = False
            if self._uploads is not None:
                # A durable save planned here writes the root alone: the uploads end first.
                (self._uploads.adopt if upload or not durable else self._uploads.drain)(
                    self._caller)
                if self._uploads.pending(req.step):
                    # A copy of this very step is being made: whether the root holds it (and
                    # so whether this save is admitted, and which version it replaces) is known
                    # only after it, and the local files it reads must not be rewritten under it.
                    self._uploads.drain(self._caller)
                self._raise_upload_failure()
        finally:  # a writer process that died may have committed before it could say so
            if restarted:
                self._durable.rescan(self._caller)
        if not (durable or local):  # the local tier skipped it and nothing else was due:
            self._given.remember(req.step, state_dict, req)  # not saved (close() may save it)
            return False
        self._given.saved(req.step)  # this save covers the steps given before
        return self._prepare(req, state_dict, on_exists="raise", durable=durable, local=local,
                             upload=upload)

    def _prepare(self, req: _Request, state_dict: Mapping[str, Any], *,
                 on_exists: str, durable: bool = True, local: bool = False,
                 upload: bool = False) -> _Ready | bool:
        """(caller thread, collective) Flatten and check the state; the coordinator plans
        (``upload``: the uploader plans the durable part later, when it copies the local step).
        """
        comm = self._caller
        prepared = comm.agree(lambda: prepare_save(state_dict, planner=self.config.planner,
                                                   trusted=req.trusted), token=req.step)
        if prepared.spmd:  # sharded XLA tensors: the local tier cannot hold them
            upload = False
        plan = comm.on_coordinator(lambda: self._durable.begin(
            req.step, forced=req.forced, world_size=comm.world_size, metrics=req.metrics,
            metadata=req.metadata, mesh=prepared.mesh, on_exists=on_exists)) if (
                durable and not upload) else None
        view = self._durable.view  # agreed: the uploads it lacks were adopted alike everywhere
        # The copy from the local tier is planned later, but the save is admitted (the lease,
        # what the root holds at that step) now, as a direct one is: a writer that lost its
        # lease raises LeaseError here, and a step the root holds is not saved to either tier.
        if upload and not comm.on_coordinator(lambda: self._durable.admits(
                req.step, forced=req.forced)):
            return False
        if local and not upload and plan is None and (durable or view.holds(req.step)):
            # The durable tier holds this step and keeps it: a new local copy would make two
            # versions of one step (which one a restore gets would depend on local retention).
            log.warning("skipping the local-tier save of step %d: the durable tier holds that "
                        "step%s", req.step, "" if durable else
                        "; save it with force=True and overwrite=True to replace it everywhere")
            local = False
        if plan is None and not local:
            return False
        self._events.emit("on_save_start", req.step)
        return _Ready(req, prepared, plan, local, upload=upload, durable_due=durable)

    def _submit(self, ready: _Ready) -> None:
        """(caller thread) Stage the state (copies: the caller may change it from now on) and
        queue its write on the worker thread (its own group); the durable part runs in the
        writer process when there is one (the state by reference, :func:`wire_items`).

        Without a writer process the job starts before the copies of plain CPU tensors into
        staging run here (:data:`OVERLAP_STAGING`): its writer waits for each buffer's copy
        (:class:`~ckptmgr._async.StagingCopies`), and this returns when every copy landed."""
        req = ready.request
        name = f"ckptmgr-save-{req.step}"
        if OVERLAP_STAGING and self._writer is None:
            staged, copies = self._stager.stage_deferred(ready.prepared.flat)
        else:
            staged, copies = self._stager.stage(ready.prepared.flat), None
        self._inflight_step = req.step
        if copies is None:
            wire = None if self._writer is None or ready.plan is None or ready.prepared.spmd \
                else wire_items(staged, self._stager, trusted=req.trusted)
            blocking_s = time.perf_counter() - req.t_call
            self._queue.submit(lambda: self._write(ready, staged, self._worker, blocking_s,
                                                   wire), name=name)
            return
        # Whether the job began (it then reads buffers, and is waited for) or was called off
        # before it began (it then returns at once): decided under one lock, since the job's
        # thread may start after the caller gave up (Ctrl-C in Thread.start()'s wait for it).
        began, called_off = [False], [False]
        lock = threading.Lock()

        def job() -> None:
            with lock:
                if called_off[0]:
                    return  # the caller raised before this began: it reads nothing
                began[0] = True
            try:
                self._write(ready, staged, self._worker, None, staging=copies)
            finally:
                close_gate(copies)  # the job's own: open for as long as it may read a buffer

        open_gate(copies)
        try:
            self._queue.submit(job, name=name)
            copies.run(req.t_call)
        except BaseException as e:
            # First of all, before any wait: the job's next read of a buffer not yet landed
            # raises (nothing of this save is committed; it cannot wait forever either).
            copies.abort(e)
            with lock:
                running = began[0]
                called_off[0] = not running
            if running:
                self._queue.wait()  # its error is this one's consequence; this one is raised
            else:
                close_gate(copies)  # no job reads: it never began, nor will
            raise

    def _preemption_save(self, req: _Request, state_dict: Mapping[str, Any],
                         signum: int) -> bool:
        """Every rank saves ``req.step`` now, waits for the commit, then exits (or returns)."""
        log.warning("preemption (signal %d) agreed at step %d: saving it before exiting",
                    signum, req.step)
        self._preempted_step = req.step
        self._given.given = None  # this is the last checkpoint: close() saves nothing after it
        try:
            with stop_if_stuck(self._writer, self.config.preemption.grace_s / 3):
                self._join_saves()
        except AsyncSaveError as e:  # the last checkpoint matters more than the one before it
            log.error("the save before the preemption failed: %s", e)
        # Whether the local tier holds the step on every rank: else the durable save is not
        # optional (a failed local save, or another root's local step with this number).
        local_holds = False
        if self._local is not None:  # the fast tier first, the durable one if the grace allows
            local_ready = self._prepare(req, state_dict, on_exists="skip", durable=False,
                                        local=True)
            try:
                if isinstance(local_ready, _Ready):  # False: the durable tier holds the step
                    self._write(replace(local_ready, durable_due=True),
                                local_ready.prepared.flat, self._caller, None)
                    local_holds = not self._local.last_skipped
            except SaveError as e:
                log.error("the local-tier preemption save failed: %s", e)
            local_holds = not self._caller.any(not local_holds)
        if self._uploads is not None:  # the root is written by one writer at a time
            self._uploads.drain(self._caller)
            try:
                self._raise_upload_failure()
            except AsyncSaveError as e:
                log.error("a durable copy before the preemption failed: %s", e)
        fits = not local_holds or self._caller.on_coordinator(lambda: fits_in_grace(
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
               blocking_s: float | None, wire: dict[str, Any] | None = None, *,
               staging: StagingCopies | None = None) -> None:
        """(collective over ``comm``) Write, commit, apply retention, agree on the new steps.

        Runs on the caller's thread for ``save`` (``comm`` is the caller's) and on the worker
        thread for ``save_async`` (the worker's); ``wire``: the durable part runs in the writer;
        ``staging``: the copies into ``flat``'s buffers still running on the caller's thread
        (the save's blocking time is theirs, known once they end).
        """
        plan, req = ready.plan, ready.request

        def blocked() -> float | None:
            return staging.blocking_s() if staging is not None else blocking_s
        # A local step due on the durable tier says so (with what its durable copy needs, and
        # which root): a restart uploads it if that root lacks it (ckptmgr.uploader).
        metadata = {**req.metadata, UPLOAD_KEY: {"mesh": ready.prepared.mesh,
                                                 "trusted": req.trusted,
                                                 "root": self._durable.url}
                    } if ready.durable_due else req.metadata
        # A step the uploader will copy is kept from local retention before it is written: the
        # local save's own retention would otherwise delete it when it is older than the
        # newest local steps kept (an older step saved again).
        uploads = self._uploads if ready.upload else None
        was_owed = uploads.pin(req.step) if uploads is not None else True
        try:
            local_err = self._local.save(
                req.step, flat, comm, metrics=req.metrics, metadata=metadata,
                trusted=req.trusted, num_threads=self.config.async_.num_of_threads,
            ) if ready.local and self._local is not None else None
        except BaseException:
            if uploads is not None:
                uploads.unpin(req.step, was_owed)
            raise
        # Another root's local step holds this step number (alike on every rank): no local
        # step was written, the durable part is saved as due.
        skipped = ready.local and self._local is not None and self._local.last_skipped
        if uploads is not None:
            job = UploadJob(req.step, blocked() or 0.0, self._stager.last_staged_bytes)
            if local_err is None and not skipped:  # the staging buffers are free after this
                uploads.submit(job)
                return
            uploads.unpin(req.step, was_owed)
            # No local step to copy: the durable part from the staged copy, as without a local
            # tier, after the uploads before it (in this process: the uploader's tier).
            done = uploads.write_now(job, lambda tier: self._write_staged(
                tier, ready, flat, comm))
            if done is not None:
                self._record_durable(req.step, done, blocked(), job.staging_bytes, req.t_call)
            if local_err is not None:
                raise local_err
            return
        if plan is None:
            if local_err is not None:
                raise local_err
            return
        try:
            if self._writer is not None and wire is not None:  # in the writer process
                out = self._writer.save(DurableJob(plan, req.trusted, wire, self._durable.view),
                                        self._stager.take_retired())
                self._durable.view = out.view
            else:
                out = self._durable.save(flat, plan, comm, spmd=ready.prepared.spmd,
                                         trusted=req.trusted)
        except BaseException:
            if plan.overwrite and ready.local and local_err is None and self._local is not None:
                # The local tier holds the new version, the root still the old one: one step,
                # two versions. The local copy goes (the failure is agreed on every rank).
                self._local.forget(req.step)
            raise
        if self._uploads is not None:  # the failed copies of older steps are superseded
            self._uploads.superseded(plan.step)
        was_blocked = blocked()
        self._record_durable(plan.step, out, was_blocked,
                             self._stager.last_staged_bytes if was_blocked is not None else 0,
                             req.t_call)
        if local_err is not None:
            raise local_err

    def _write_staged(self, tier: DurableTier, ready: _Ready, flat: dict[str, Any],
                      comm: Comm) -> DurableOutcome | None:
        """(collective over ``comm``) Plan and write ``ready``'s durable part from ``flat``
        through ``tier`` (the uploader's, while no upload runs); None: the root holds the step."""
        req = ready.request
        plan = comm.on_coordinator(lambda: tier.begin(
            req.step, forced=req.forced, world_size=comm.world_size, metrics=req.metrics,
            metadata=req.metadata, mesh=ready.prepared.mesh, on_exists="raise"))
        if plan is None:
            return None
        return tier.save(flat, plan, comm, spmd=ready.prepared.spmd, trusted=req.trusted)

    def _uploaded(self, job: UploadJob, out: DurableOutcome) -> None:
        """(uploader thread) A durable copy committed: its figures, as for a save."""
        self._record_durable(job.step, out, job.blocking_s, job.staging_bytes, None)

    def _record_durable(self, step: int, out: DurableOutcome, blocking_s: float | None,
                        staging_bytes: int, t_call: float | None) -> None:
        """Record, log and announce a durable commit (``blocking_s`` None: a blocking save,
        which blocked since ``t_call``)."""
        if blocking_s is None:
            blocking_s = time.perf_counter() - (t_call or time.perf_counter())
            took = blocking_s
        else:
            took = blocking_s + out.write_s
        stats = SaveStats(step=step, blocking_s=blocking_s, write_s=out.write_s,
                          bytes=out.bytes_written, total_bytes=out.total_bytes,
                          staging_bytes=staging_bytes, pinned_bytes=self._stager.pinned_nbytes)
        self._last_stats = stats
        if self.config.preemption.enabled and not self._grace_warned:
            self._grace_warned = warn_if_over_grace(step, took, self.config.preemption.grace_s)
        log_save(stats, self._durable.url)
        self._events.emit("on_save_end", stats)
