"""The durable tier: the root (``path``) as one object, one world-size-N checkpoint per step.

A :class:`DurableTier` owns what is fixed for the life of a root: its step store (every step
directory, the one fenced door for removals), its retention policy, its writer-lease fence, the
number of write streams, the planners kept across saves, and the view of the root the ranks
agreed on (our committed steps with what retention needs, and plain-DCP steps).

One recipe builds it, :meth:`DurableTier.from_config`, from a
:class:`~ckptmgr.config.ManagerConfig`: the manager builds it in the training process, and the
writer process (:mod:`ckptmgr.writer_process`, ``async_mode="process"``) builds the same object
from the same configuration, so a save runs the same code in either place.

Call order (collectives over the ``comm`` given, same order on every rank):
1) (all ranks) :meth:`DurableTier.open` in the constructor: the coordinator takes the writer
   lease (unless read-only) and lists the root; the view is broadcast.
2) (coordinator) :meth:`DurableTier.begin` plans a save (fenced); (all ranks)
   :meth:`DurableTier.save` writes and commits it, applies retention on the coordinator
   (fenced), and agrees on the new view.
3) (all ranks) :meth:`DurableTier.restore` reads a step in place; :meth:`DurableTier.rescan`
   lists the root again (a reader's view, or after a writer process died).

Shared chunks (``reuse_unchanged=True``, docs/byte-format.md): as a save begins, on the thread or
process that writes (never the training thread), the coordinator lists ``chunks/`` and every
rank gets the list; a rank references a listed chunk whose bytes its staged chunk hashes to, and
writes the others. After the commit, the coordinator removes the chunks no committed manifest
lists (:meth:`StepStore.remove_unreferenced_chunks`, fenced). That can never remove a chunk a
save is writing or about to reference, because nothing else is in flight then: saves of one
root run one at a time (the writer lease keeps other jobs out; a manager's queue runs one save,
its retention and this sweep to the end before the next save begins, whether it runs on the
worker thread or, with ``async_mode="process"``, in the writer process, where this same object
does both), and the chunk list of a save is taken after the previous save's sweep ended. A crash
anywhere leaves at worst chunks no committed step lists; the first commit of the next writer
sweeps them (and so does ``ckptmgr prune``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ckptmgr._dist import Comm
from ckptmgr.codec.layout import attempt_in_name, shared_chunk_digest
from ckptmgr.codec.manifest import Manifest
from ckptmgr.config import ManagerConfig
from ckptmgr.dcp.checkpoint import (
    SavePlanners,
    load_step,
    prepare_restore,
    read_restore_source,
    write_step,
)
from ckptmgr.dcp.planner import REUSE_CHUNK_BYTES
from ckptmgr.errors import (
    CkptmgrError,
    CorruptCheckpointError,
    LeaseError,
    RestoreError,
    SaveError,
    StorageError,
)
from ckptmgr.formats.plain_dcp import load_foreign, prepare_foreign_restore
from ckptmgr.lease import Lease, LeaseInfo
from ckptmgr.policy import RetentionPolicy, StepRecord, build_policy, steps_to_delete
from ckptmgr.step_store import CommitPlan, StepStore, deleted_while_read
from ckptmgr.storage import open_storage, retry_budget

__all__ = ["DurableOutcome", "DurableTier", "View", "fits_in_grace", "retention_policy"]

log = logging.getLogger("ckptmgr")

_RESTORE_TRIES = 3  # a step overwritten while it is read is read again (old or new, never mixed)


@dataclass(frozen=True)
class View:
    """The root's steps the ranks agreed on: ours (with what retention needs) and plain-DCP
    ones (listed and restorable, never written or deleted)."""

    records: dict[int, StepRecord] = field(default_factory=dict)
    foreign: frozenset[int] = frozenset()

    def holds(self, step: int) -> bool:
        """Whether ``step`` is a step of the root (ours or plain DCP)."""
        return step in self.records or step in self.foreign


@dataclass(frozen=True)
class DurableOutcome:
    """What a durable save did, on every rank: this rank's bytes, every rank's, the seconds
    writing and committing took, and the root's view after retention."""

    bytes_written: int
    total_bytes: int
    write_s: float
    view: View


def retention_policy(cfg: ManagerConfig) -> RetentionPolicy:
    """The durable tier's retention policy of ``cfg``."""
    ret = cfg.retention
    return build_policy(max_to_keep=ret.max_to_keep, keep_period=ret.keep_period,
                        keep_time_interval=ret.keep_time_interval,
                        best_metric=ret.best_metric, best_mode=ret.best_mode,
                        keep_best=ret.keep_best)


class DurableTier:
    """The root of a manager: step store, retention, lease fence, streams and the agreed view.

    Args:
        store: the root's step store.
        policy: retention over the committed steps (DESIGN.md section 7).
        num_threads: write streams per rank (None: the writer's default).
        read_manifests: whether listing the root reads every manifest (time-based or metric
            retention, ``best_step``).
        overwrite, verify, planner, read_only: the manager's settings of these names.
        reuse_unchanged: share unchanged tensor chunks across steps (docs/byte-format.md,
            "Shared chunks"): large tensors are cut into row blocks, and a block whose bytes a
            shared chunk of the root holds already is referenced instead of written.
    """

    def __init__(self, store: StepStore, *, policy: RetentionPolicy, num_threads: int | None,
                 read_manifests: bool, overwrite: bool = False, verify: bool = True,
                 planner: str = "auto", read_only: bool = False,
                 reuse_unchanged: bool = False) -> None:
        self.store = store
        self.policy = policy
        self.num_threads = num_threads
        self.read_manifests = read_manifests
        self.overwrite = overwrite
        self.verify = verify
        self.planner = planner
        self.read_only = read_only
        self.reuse_unchanged = reuse_unchanged
        # Kept across saves: an unchanged state reuses its plans.
        self.planners = SavePlanners(chunk_bytes=REUSE_CHUNK_BYTES if reuse_unchanged else None)
        self.lease: Lease | None = None
        self.view = View()
        self._alive: Callable[[], None] | None = None  # the writer process: its parent lives
        # (coordinator) The shared chunks of the newest step this tier committed: step and
        # digest -> (size, checksum), so that the next save need not read its manifest.
        self._newest_shared: tuple[int, dict[str, tuple[int, str]]] | None = None
        # (coordinator) Whether unreferenced shared chunks may exist beyond what the deletions
        # of the next commit leave: at first (a crashed run before this one), after a failure.
        self._sweep_due = True

    @classmethod
    def from_config(cls, cfg: ManagerConfig) -> DurableTier:
        """The one wiring recipe of a root: the same objects from the same configuration, in
        the training process and in the writer process. Opens no lease and lists nothing."""
        ret = cfg.retention
        store = StepStore(open_storage(cfg.path, cfg.storage.options,
                                       writable=not cfg.read_only))
        return cls(store, policy=retention_policy(cfg), num_threads=cfg.async_.num_of_threads,
                   read_manifests=ret.best_metric is not None or (
                       bool(ret.max_to_keep) and ret.keep_time_interval is not None),
                   overwrite=cfg.overwrite, verify=cfg.verify, planner=cfg.planner,
                   read_only=cfg.read_only, reuse_unchanged=cfg.reuse_unchanged)

    @property
    def url(self) -> str:
        """The root URL, credentials redacted."""
        return self.store.url

    # ---------------------------------------------------------------------------- the lease

    def open(self, comm: Comm, *, take_over: bool) -> None:
        """(collective over ``comm``) The coordinator takes the writer lease unless read-only
        (every commit and removal is then fenced by it) and lists the root; every rank gets
        that view.

        Raises:
            LeaseError: another live job writes this root (on every rank).
        """
        def on_coordinator() -> View:
            if not self.read_only:
                self.lease = Lease(self.store.storage)
                self.lease.acquire(take_over=take_over)
                self.store.fence = self.check_lease
            return self.scan()

        self.view = comm.on_coordinator(on_coordinator)

    def follow_lease(self, info: LeaseInfo | None, *, alive: Callable[[], None]) -> None:
        """(writer process) Fence every commit and removal by the training process's lease
        (read from storage, never renewed here) and by ``alive`` (raises once it is gone)."""
        self.lease = Lease.follow(self.store.storage, info) if info is not None else None
        self._alive = alive
        self.store.fence = self.check_lease

    def check_lease(self) -> None:
        """Raise LeaseError unless this writer still holds the root's lease (and, in the writer
        process, the training process is alive)."""
        if self._alive is not None:
            self._alive()
        if self.lease is not None:
            self.lease.check()

    def release(self) -> None:
        """Release the writer lease (idempotent). The released lease stays this tier's fence:
        its check raises from now on, so a save still running (close() interrupted while it
        waited) commits and removes nothing in a root another job may write by then."""
        if self.lease is not None:
            self.lease.release()

    # ------------------------------------------------------------------------------ the view

    def scan(self) -> View:
        """(coordinator) List the root; read manifests only if retention needs them."""
        scan = self.store.scan()
        records = self.store.records(scan.committed, read_manifests=self.read_manifests)
        if scan.dcp_steps:
            log.warning("%s holds %d steps written by plain DCP (%s): listed, restorable with "
                        "trusted=True, never written or deleted by ckptmgr", self.url,
                        len(scan.dcp_steps), scan.dcp_steps[-5:])
        return View(records, frozenset(scan.dcp_steps))

    def rescan(self, comm: Comm) -> None:
        """(collective over ``comm``) List the root again; every rank gets the coordinator's
        view (a reader's view is from when it opened; a writer process that died may have
        committed before it could say so)."""
        self.view = comm.on_coordinator(self.scan)

    # ------------------------------------------------------------------------------- saving

    def begin(self, step: int, *, forced: bool, world_size: int, metrics: dict[str, float],
              metadata: dict[str, Any], mesh: Any, on_exists: str) -> CommitPlan | None:
        """(coordinator) Plan the save of ``step`` (fenced); None: the root holds it already.

        Raises:
            SaveError: the root could not be read within one retry budget.
            LeaseError, CheckpointExistsError: as :meth:`StepStore.begin_save`.
        """
        try:
            # Planning reads the root (the lease, the step's directory): with the store gone
            # or hanging it fails within one retry budget, like the writes that follow.
            with retry_budget():
                self.check_lease()
                return self.store.begin_save(
                    step, forced=forced, overwrite=self.overwrite, world_size=world_size,
                    metrics=metrics, metadata=metadata, mesh=mesh, on_exists=on_exists)
        except StorageError as e:
            raise SaveError(f"save of step {step} to {self.url} failed: {e}", step=step,
                            failures={0: e}) from e

    def admits(self, step: int, *, forced: bool) -> bool:
        """(coordinator) Whether a save of ``step`` would be planned now (fenced; changes
        nothing): a save whose durable part is made later from the local tier is refused, or
        skipped, when it is called, as :meth:`begin` would refuse or skip it.

        Raises:
            SaveError, LeaseError, CheckpointExistsError: as :meth:`begin`.
        """
        try:
            with retry_budget():
                self.check_lease()
                return self.store.admits_save(step, forced=forced,
                                              overwrite=self.overwrite) is not None
        except StorageError as e:
            raise SaveError(f"save of step {step} to {self.url} failed: {e}", step=step,
                            failures={0: e}) from e

    def save(self, flat: dict[str, Any], plan: CommitPlan, comm: Comm, *, spmd: bool,
             trusted: bool) -> DurableOutcome:
        """(collective over ``comm``) Write and commit ``plan``'s step, apply retention on the
        coordinator (fenced), agree on the new view.

        The same code runs in the training process (``async_mode="thread"``, and synchronous
        saves) and in the writer process (``"process"``).
        """
        t_write = time.perf_counter()
        try:
            if self.reuse_unchanged and not spmd:  # the XLA-SPMD planner keeps whole steps
                # Here, on the thread (or process) that writes, not when the save was planned
                # on the training thread: listing the chunks must not add to save_async's
                # blocked time.
                plan = dataclasses.replace(plan, reuse=comm.on_coordinator(self._reusable))
            outcome = write_step(flat, self.store, plan, rank=comm.rank, group=comm.group,
                                 planner=self.planners.get(spmd), trusted=trusted,
                                 num_threads=self.num_threads,
                                 fence=self.check_lease if comm.is_coordinator else None,
                                 arrivals=comm.arrivals)
        except BaseException:
            self._sweep_due = True  # chunks the failed attempt wrote are referenced by none
            raise
        write_s = time.perf_counter() - t_write
        view = comm.on_coordinator(lambda: self._after_commit(plan, outcome.manifest))
        total = sum(comm.all_gather(outcome.bytes_written))
        self.view = view
        return DurableOutcome(outcome.bytes_written, total, write_s, view)

    def _reusable(self) -> dict[str, tuple[int, str | None]]:
        """(coordinator, as a save with reuse begins) The shared chunks the save may reference:
        every chunk of the root as listed now (no chunk is removed while a save is in flight,
        and a chunk's name appears only once its bytes are whole), with its checksum where the
        newest committed step lists it (the others' are computed from the staged bytes). A root
        that cannot be listed reuses nothing: every chunk is written."""
        try:
            listed = self.store.shared_sizes()
        except CkptmgrError as e:
            log.warning("reuse_unchanged: could not list the shared chunks of %s (%s); this "
                        "save writes every chunk", self.url, e)
            return {}
        known = self._newest_sums()
        out: dict[str, tuple[int, str | None]] = {}
        for path, size in listed.items():
            digest = shared_chunk_digest(path)
            entry = known.get(digest)
            out[digest] = (size, entry[1] if entry is not None and entry[0] == size else None)
        return out

    def _newest_sums(self) -> dict[str, tuple[int, str]]:
        """(coordinator) digest -> (size, checksum) of the shared chunks of the newest committed
        step (remembered from its commit, else read from its manifest); {} when none."""
        ours = [s for s in self.view.records]
        if not ours:
            return {}
        newest = max(ours)
        if self._newest_shared is not None and self._newest_shared[0] == newest:
            return self._newest_shared[1]
        try:
            manifest = self.store.read_manifest(newest)
        except CkptmgrError as e:
            log.warning("reuse_unchanged: the manifest of step %d cannot be read (%s)", newest, e)
            return {}
        sums = _shared_sums(manifest)
        self._newest_shared = (newest, sums)
        return sums

    def _after_commit(self, plan: CommitPlan, manifest: Manifest | None) -> View:
        """(coordinator) The root after a commit: record it, drop replaced attempts, apply
        retention, remove leftovers of crashed saves. Retention never deletes the step this save
        committed, the newest committed step, or anything ckptmgr did not write. Every removal
        goes through the store's fenced door: a writer that lost its lease after committing
        removes nothing (another job may be writing into the root by then)."""
        assert manifest is not None, "coordinator has no manifest after commit"
        store, foreign = self.store, self.view.foreign
        records = dict(self.view.records)
        records[plan.step] = StepRecord(step=plan.step, time=manifest.unix_time,
                                        metrics=dict(manifest.metrics))
        if plan.step >= max(records):
            self._newest_shared = (plan.step, _shared_sums(manifest))
        if not plan.staged:
            store.remove_replaced_attempts(plan)
        # Nothing else is in flight: the only save in flight is the one that just committed.
        doomed = [s for s in steps_to_delete([records[s] for s in sorted(records)], self.policy)
                  if s != plan.step]
        # An overwrite or a deletion can leave shared chunks that no step references any more.
        sweep = self._sweep_due or plan.overwrite or bool(doomed)
        for s in doomed:
            try:
                store.delete_step(s)
            except LeaseError as e:  # fenced: nothing more is removed by this writer
                log.error("retention after committing step %d stopped: %s", plan.step, e)
                return View(records, foreign)
            except CkptmgrError as e:  # retention is best effort; the new step is committed
                log.warning("retention could not delete step %d: %s", s, e)
                continue
            log.info("retention deleted step %d from %s", s, store.url)
            del records[s]
        try:  # best effort: the step is committed whatever happens here
            scan = store.scan()
            store.remove_leftovers(scan, keep_attempt=plan.attempt)
            if scan.shared_dir and sweep:
                # After the commit, with nothing else in flight (module docstring): no chunk
                # a save is writing or about to reference can be removed here.
                store.remove_unreferenced_chunks()
            self._sweep_due = False
            return View(records, frozenset(scan.dcp_steps))
        except LeaseError as e:
            log.error("after committing step %d: no leftovers removed: %s", plan.step, e)
        except CkptmgrError as e:
            log.warning("after committing step %d: could not list the root to remove leftovers: "
                        "%s", plan.step, e)
        return View(records, foreign)  # the plain-DCP steps as known before

    # ----------------------------------------------------------------------------- reading

    def restore(self, step: int, state_dict: Mapping[str, Any], comm: Comm, *,
                allow_partial: bool, trusted: bool) -> int:
        """(collective over ``comm``) Restore ``step`` of the view in place; the bytes this rank
        read (0 for a plain-DCP step, read with DCP's own reader).

        The caller found ``step`` in :attr:`view`. Our steps: the coordinator alone reads the
        manifest and metadata and shares them; a step overwritten by the job writing the root
        while it is read is read again, so the result is the old or the new version, never a
        mix, and never a false "damaged".

        Raises:
            CheckpointNotFoundError: the step was deleted while it was read.
            The errors of :meth:`ckptmgr.CheckpointManager.restore`.
        """
        with retry_budget():  # one budget for the whole restore: its reads, re-reads and checks
            if step in self.view.foreign:
                prepared_foreign = comm.agree(lambda: prepare_foreign_restore(
                    self.store.storage, step, state_dict, planner=self.planner,
                    allow_partial=allow_partial, trusted=trusted), token=step)
                load_foreign(prepared_foreign, rank=comm.rank, world_size=comm.world_size,
                             group=comm.group)
                return 0
            for tries_left in reversed(range(_RESTORE_TRIES)):
                try:
                    return self._read(step, state_dict, comm, allow_partial=allow_partial,
                                      trusted=trusted)
                except _Overwritten as o:
                    if not tries_left:
                        raise RestoreError(
                            f"step {step} in {self.url} was overwritten by the job writing this "
                            f"root each of the {_RESTORE_TRIES} times it was read; it is not "
                            "damaged: restore it again, or restore another step",
                            step=step) from o.__cause__
                    log.warning("step %d was overwritten while it was read; reading it again",
                                step)
        raise AssertionError("unreachable")

    def _read(self, step: int, state_dict: Mapping[str, Any], comm: Comm, *,
              allow_partial: bool, trusted: bool) -> int:
        """(collective) One read of our ``step``; _Overwritten when another attempt replaced
        the one read meanwhile."""
        attempt: str | None = None  # the attempt whose files this try reads, once known
        try:
            source = comm.on_coordinator(  # nobody else lists or reads manifest, metadata
                lambda: read_restore_source(self.store, step, verify=self.verify))
            attempt = source.manifest.attempt
            prepared = comm.agree(partial(prepare_restore, source, step, state_dict,
                                          planner=self.planner, allow_partial=allow_partial,
                                          trusted=trusted, world_size=comm.world_size),
                                  token=step)
            return load_step(prepared, self.store, step, rank=comm.rank,
                             world_size=comm.world_size, group=comm.group, verify=self.verify,
                             trusted=trusted, arrivals=comm.arrivals)
        except (CorruptCheckpointError, StorageError) as e:
            # An overwrite by the writing job removes the replaced attempt's files (the metadata
            # or a data file, even while it is listed): the step is not damaged, it is newer.
            # Read it again; only a step that stayed the same is damaged.
            if attempt is None:  # failed before the manifest was agreed: the file names it
                attempt = attempt_in_name(getattr(e, "path", None))
            # Deleted meanwhile (retention of the job writing the root): not damaged, gone.
            deleted = comm.on_coordinator(partial(deleted_while_read, self.store, step))
            if deleted is not None:
                raise deleted from e
            if attempt is None or not comm.on_coordinator(
                    partial(self._overwritten, step, attempt)):
                raise
            raise _Overwritten() from e

    def _overwritten(self, step: int, attempt: str) -> bool:
        """(coordinator) Whether ``step`` now holds another attempt than ``attempt``."""
        return self.store.current_attempt(step) not in (attempt, None)

    def check_listed(self, step: int, available: list[int]) -> None:
        """(coordinator) Raise unless ``step`` is in ``available`` (the steps of every tier the
        ranks agreed on). No I/O for a listed step: the step store checks it once, when it reads
        its manifest (committed, no symbolic link, well-formed).

        Raises:
            UnsafeCheckpointError: not listed because its directory is a symbolic link.
            CheckpointNotFoundError: not listed (IncompleteCheckpointError: its directory exists
                but never committed); lists ``available``.
        """
        if step not in available:
            self.store.check_not_symlink(step)  # say why a link is not listed
            raise self.store.not_found(step, available)

    def read_manifest(self, step: int) -> Manifest:
        """The manifest of our committed ``step`` (local; reads it).

        Raises:
            CheckpointNotFoundError, CorruptCheckpointError: as :meth:`StepStore.read_manifest`.
        """
        return self.store.read_manifest(step)


def _shared_sums(manifest: Manifest) -> dict[str, tuple[int, str]]:
    """digest -> (size, checksum) of the shared chunks ``manifest`` lists."""
    return {shared_chunk_digest(f.path): (f.size, f.checksum) for f in manifest.shared}


class _Overwritten(Exception):
    """A read met another save attempt of its step than the one it began with."""


def fits_in_grace(elapsed_s: float, last: Any, grace_s: float) -> bool:
    """(coordinator) Whether a durable save still fits in the preemption grace period after the
    local one: ``elapsed_s`` since the agreement plus the last durable write (``last``: its
    SaveStats, None when this process made none: then try) within ``grace_s``."""
    need = getattr(last, "write_s", None)
    if need is None or elapsed_s + need <= grace_s:
        return True
    log.warning("preemption: the local tier holds the step; skipping the durable save (%.1f s "
                "elapsed + %.1f s for the last durable write > preemption_grace_s=%.1f s)",
                elapsed_s, need, grace_s)
    return False
