"""Durable copies made from the local tier's files, in the background (``save_async`` of a step
due on both tiers, with a local tier).

The save queue's job writes the local step from the staging buffers, then hands the step to the
:class:`Uploader` and ends: the staging buffers are free for the next save while the durable copy
is made. The uploader's thread rebuilds each rank's part of the durable save from the rank's own
committed local step (:func:`mapped_state`: tensors memory-mapped from the local data files and
checked against their checksums, Python values as the bytes they were stored as, DTensor shards
with the chunk recorded in the local manifest) and saves it with
:meth:`~ckptmgr.durable.DurableTier.begin` and :meth:`~ckptmgr.durable.DurableTier.save`, as a
direct durable save does: the same commit protocol, retention and metadata, restorable at any
world size.

Policy: at most one upload in flight and one waiting. A save job that would queue a third waits
(in the background, after its local commit) until the one in flight ends, so the training thread
waits only at the save after it, and only when uploads fall behind. A local step owed to the
durable tier (waiting, in flight, or failed) is kept by local retention until it is uploaded or a
newer step reaches the durable tier (which supersedes it), also when a rank cannot read its part
(an I/O error is not a finding: only damaged or missing files end an owed copy for good).

Call order (every collective over the uploader's own gloo group, made at construction; a gloo
group is used by one thread at a time):
1) (all ranks, constructor) :meth:`Uploader.owed_at_start`: local steps due on the durable tier,
   newer than its newest step and missing there (an upload a restart interrupted) are queued.
2) (all ranks, the save queue's worker, same order) :meth:`Uploader.submit` after the local
   commit; :meth:`Uploader.write_now` when the local write failed (the durable part from the
   staged copy, after the uploads before it).
3) (uploader thread, all ranks, same order) each job: read and check this rank's part (agreed:
   a rank whose part is damaged fails the upload everywhere), plan on the coordinator, write and
   commit, retention; bounded retries, agreed.
4) (caller thread, all ranks) :meth:`Uploader.adopt` at each due save: the jobs finished on every
   rank become the manager's durable view (so readers agree); :meth:`Uploader.drain` waits for
   every job first (``join``, ``close``, a direct durable save).
"""

from __future__ import annotations

import copy
import logging
import math
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptmgr._dist import Comm
from ckptmgr.codec.checksum import Hasher
from ckptmgr.codec.metadata import ItemLocation
from ckptmgr.dcp.checkpoint import RestoreSource, SavePlanners
from ckptmgr.dcp.planner import REUSE_CHUNK_BYTES
from ckptmgr.dcp.shards import StagedDTensor
from ckptmgr.dcp.writer import EncodedValue
from ckptmgr.durable import DurableOutcome, DurableTier, View
from ckptmgr.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    LeaseError,
    SaveError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptmgr.local_tier import LAYOUT_KEY, UPLOAD_KEY, LocalTier, is_read_failure
from ckptmgr.storage import is_not_found

__all__ = ["UploadJob", "Uploader", "mapped_state"]

log = logging.getLogger("ckptmgr")

# Failures another try cannot fix: damaged or missing local files, a lost lease, a step the root
# refuses, a value that needs trust.
_FINAL = (CorruptCheckpointError, CheckpointNotFoundError, LeaseError, CheckpointExistsError,
          UnsafeCheckpointError, ConfigError)


@dataclass(frozen=True)
class UploadJob:
    """One durable copy to make from the local step ``step`` (the same on every rank)."""

    step: int
    blocking_s: float = 0.0  # how long the save call that made the local step blocked
    staging_bytes: int = 0


@dataclass
class _Done:
    """A finished job: the durable view after it (the coordinator's, alike on every rank), its
    outcome (None: failed, or skipped because the root held the step), its failure."""

    job: UploadJob
    view: View
    outcome: DurableOutcome | None
    error: BaseException | None
    overwrite: bool = False  # it replaced a committed step (a failure then drops the local copy)


_VERIFY_BYTES = 8 << 20  # read at a time while an item's bytes are checked


def _pread(fd: int, buf: memoryview, offset: int) -> int:
    """Bytes read into ``buf`` from ``offset`` of ``fd`` (its own function: a test injects
    the I/O error a failing disk gives, which no healthy file produces)."""
    return os.preadv(fd, [buf], offset)


def mapped_state(source: RestoreSource, step_dir: str) -> tuple[dict[str, Any], list[Any]]:
    """This rank's flat state for the durable writer, from its committed local step: tensors
    memory-mapped from the data files (copy-on-write, so nothing writes the files), each
    item's bytes read and checked against its checksum first; Python values as stored (never
    decoded, never unpickled); DTensor shards as :class:`~ckptmgr.dcp.shards.StagedDTensor`
    with the chunk the local manifest records. Returns the state and the maps (kept while it
    is used).

    The check reads with ``pread``, not through the map: a disk's read error is then an
    exception (a read failure: the step stays owed and is tried again), where a mapped page
    that cannot be read kills the process with ``SIGBUS``. The writer then reads the pages the
    check has just brought into the page cache; one evicted in between and unreadable on the
    second read would still raise ``SIGBUS`` (a disk that read it a moment before).

    Raises:
        CorruptCheckpointError: a file missing, short, or not listed, or bytes that do not
            match their checksum (damaged bytes are never uploaded).
        StorageError: a read failed (from the ``OSError``; a missing file is the error above).
    """
    manifest, md = source.manifest, source.metadata
    info = manifest.metadata.get(LAYOUT_KEY) or {}
    dtensors = info.get("dtensors") or {}
    locations = md.storage_data
    maps: dict[str, mmap.mmap] = {}
    fds: dict[str, int] = {}
    scratch = memoryview(bytearray(0))

    def damaged(what: str, path: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"local step {manifest.step} in {step_dir}: {path}: {what}; it is not uploaded",
            step=manifest.step, path=path)

    def located(index: MetadataIndex) -> ItemLocation:
        loc = None if locations is None else locations.get(index)
        if not isinstance(loc, ItemLocation):
            raise damaged(f"no stored bytes for {index.fqn!r}", manifest.metadata_file)
        try:
            size = manifest.file(loc.file).size
        except KeyError:
            raise damaged("not listed in the manifest", loc.file) from None
        if source.sizes.get(loc.file) != size:
            raise damaged(f"missing or not {size} bytes long", loc.file)
        if loc.offset < 0 or loc.offset + loc.length > size:
            raise damaged(f"bytes of {index.fqn!r} lie beyond the end of the file", loc.file)
        return loc

    def read_failed(path: str, e: OSError) -> StorageError | CorruptCheckpointError:
        if is_not_found(e):  # removed since it was listed: a finding, as a missing file is
            return damaged("missing", path)
        return StorageError(
            f"local step {manifest.step} in {step_dir}: reading {path} for its upload failed: "
            f"{e.strerror or e}; check the disk of the local tier (the upload is tried again "
            "while the step is owed)")

    def verified(loc: ItemLocation, fqn: str) -> None:
        nonlocal scratch
        if len(scratch) < min(loc.length, _VERIFY_BYTES):
            scratch = memoryview(bytearray(min(max(loc.length, 1 << 20), _VERIFY_BYTES)))
        h, pos, end = Hasher(), loc.offset, loc.offset + loc.length
        while pos < end:
            part = scratch[:min(len(scratch), end - pos)]
            try:
                got = _pread(fds[loc.file], part, pos)
            except OSError as e:
                raise read_failed(loc.file, e) from e
            if not got:
                raise damaged("changed size while read", loc.file)
            h.update(part[:got])
            pos += got
        if h.value() != loc.checksum:
            raise damaged(f"checksum mismatch in the bytes of {fqn!r}", loc.file)

    def view(loc: ItemLocation, fqn: str) -> memoryview:
        if not loc.length:
            return memoryview(b"")
        mm = maps.get(loc.file)
        if mm is None:
            path = os.path.join(step_dir, loc.file)
            try:
                fd = fds[loc.file] = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                mm = maps[loc.file] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            except OSError as e:
                raise read_failed(loc.file, e) from e
            except ValueError:  # "cannot mmap an empty file": emptied since it was listed
                raise damaged("changed size while read", loc.file) from None
            if len(mm) != manifest.file(loc.file).size:  # changed since it was listed
                raise damaged("changed size while read", loc.file)
        verified(loc, fqn)
        return memoryview(mm)[loc.offset:loc.offset + loc.length]

    flat: dict[str, Any] = {}
    try:
        _map_items(md, dtensors, located, view, damaged, flat)
    finally:
        for fd in fds.values():
            os.close(fd)
    return flat, list(maps.values())


def _map_items(md: Any, dtensors: dict[str, Any], located: Callable[[MetadataIndex], Any],
               view: Callable[[Any, str], memoryview],
               damaged: Callable[[str, str], CorruptCheckpointError],
               flat: dict[str, Any]) -> None:
    """:func:`mapped_state`'s state, item by item, into ``flat``."""
    with torch.no_grad():
        for fqn, entry in md.state_dict_metadata.items():
            if isinstance(entry, BytesStorageMetadata):
                loc = located(MetadataIndex(fqn))
                if loc.enc not in ("json", "pickle"):
                    raise damaged(f"value {fqn!r} has encoding {loc.enc!r}", loc.file)
                flat[fqn] = EncodedValue(bytes(view(loc, fqn)), loc.enc)
                continue
            assert isinstance(entry, TensorStorageMetadata)
            tensor = _tensor(fqn, entry, located, view, damaged)
            layout = dtensors.get(fqn)
            if layout is None:
                flat[fqn] = tensor
                continue
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                      for o, s in layout["chunks"]]
            flat[fqn] = StagedDTensor(tensor, global_shape=layout["shape"], dtype=tensor.dtype,
                                      chunks=chunks,
                                      properties=TensorProperties.create_from_tensor(tensor))


def _tensor(fqn: str, entry: TensorStorageMetadata, located: Callable[[MetadataIndex], Any],
            view: Callable[[Any, str], memoryview],
            damaged: Callable[[str, str], CorruptCheckpointError]) -> torch.Tensor:
    """One stored tensor of a world-size-1 step: a view of its mapped bytes (or, if it was
    stored in several chunks, a tensor assembled from them)."""
    dtype, size = entry.properties.dtype, tuple(entry.size)
    itemsize = torch.empty((), dtype=dtype).element_size()
    pieces = []
    for chunk in entry.chunks:
        loc = located(MetadataIndex(fqn, chunk.offsets))
        sizes = tuple(chunk.sizes)
        if loc.enc != "raw" or math.prod(sizes) * itemsize != loc.length:
            raise damaged(f"{fqn!r}: {loc.length} bytes ({loc.enc}) for {list(sizes)} "
                          f"{dtype}", loc.file)
        data = view(loc, fqn)
        t = (torch.frombuffer(data, dtype=dtype) if loc.length
             else torch.empty(0, dtype=dtype)).reshape(sizes)
        pieces.append((tuple(chunk.offsets), t))
    if len(pieces) == 1 and pieces[0][1].shape == size and not any(pieces[0][0]):
        return pieces[0][1]
    out = torch.empty(size, dtype=dtype)
    for offsets, t in pieces:
        dst = out
        for dim, (o, s) in enumerate(zip(offsets, t.shape, strict=True)):
            dst = dst.narrow(dim, o, s)
        dst.copy_(t)
    return out


class Uploader:
    """Durable copies of local steps, made on one background thread (module docstring).

    Args:
        durable: the manager's durable tier (its view stays the caller's; the uploader writes
            through a twin sharing its store, lease and policy, with a view of its own).
        local: this rank's local tier (reads each step; keeps owed steps from retention).
        comm: the uploader's own group (used by the uploader thread, and by the save worker
            in :meth:`write_now` only while no upload runs).
        on_commit: called (uploader thread) after each durable commit with the job and outcome.
        tries: durable saves tried per job before it fails.
        retry_s: wait before the second try (doubled for each one after).
    """

    def __init__(self, durable: DurableTier, local: LocalTier, comm: Comm, *,
                 on_commit: Callable[[UploadJob, DurableOutcome], None] | None = None,
                 tries: int = 3, retry_s: float = 1.0) -> None:
        self._main = durable
        self.tier = copy.copy(durable)  # same store, lease, policy and settings
        # Its plans are of mapped state: kept apart, cut into blocks as the manager's are.
        self.tier.planners = SavePlanners(
            chunk_bytes=REUSE_CHUNK_BYTES if durable.reuse_unchanged else None)
        self._local = local
        self.comm = comm
        self._on_commit = on_commit
        self.tries = tries
        self.retry_s = retry_s
        self._cond = threading.Condition()
        self._jobs: deque[UploadJob] = deque()
        self._running: UploadJob | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._submitted = 0  # jobs given on this rank (alike on every rank once the saves ended)
        self._unadopted: deque[int] = deque()  # steps of the jobs given, not yet adopted, in order
        self._adopted = 0  # jobs whose view the caller adopted (agreed)
        self._done: list[_Done] = []  # finished, not yet adopted, in order
        self._failed: list[_Done] = []  # adopted failures not yet raised
        self._failed_steps: set[int] = set()  # owed: their uploads failed (kept locally)
        self._overwriting = False  # the job in flight replaces a committed step

    # ------------------------------------------------------------------ the save side (queue)

    @property
    def busy(self) -> bool:
        """Whether a job runs or waits on this rank."""
        with self._cond:
            return self._running is not None or bool(self._jobs)

    def submit(self, job: UploadJob, *, wait_for_slot: bool = True) -> None:
        """Queue ``job`` (every rank, same order). With one job in flight and one waiting, waits
        for the one in flight to end first (``wait_for_slot``)."""
        with self._cond:
            while wait_for_slot and self._running is not None and self._jobs:
                self._cond.wait()
            self._sync_view()
            self._local.owed.add(job.step)
            self._jobs.append(job)
            self._submitted += 1
            self._unadopted.append(job.step)
            if self._thread is None:
                # Not a daemon: an interpreter that exits waits for the commit, as for saves.
                self._thread = threading.Thread(target=self._loop, daemon=False,
                                                name=f"ckptmgr-upload-{job.step}")
                self._thread.start()

    def write_now(self, job: UploadJob, write: Callable[[DurableTier], DurableOutcome | None]
                  ) -> DurableOutcome | None:
        """(the save worker, every rank) Run ``write`` (a durable save through the uploader's
        tier, collective over the worker's group) after every upload queued before it, as a
        job of its own; its failure is raised here."""
        with self._cond:
            while self._running is not None or self._jobs:
                self._cond.wait()
            self._sync_view()
            self._running = job
            self._submitted += 1
            self._unadopted.append(job.step)
        outcome: DurableOutcome | None = None
        err: BaseException | None = None
        try:
            outcome = write(self.tier)
            return outcome
        except BaseException as e:
            err = e
            raise
        finally:
            with self._cond:
                self._done.append(_Done(job, self.tier.view, outcome, None))
                self._running = None
                self._cond.notify_all()
            if err is None and outcome is not None:
                self._superseded(job.step)

    def _sync_view(self) -> None:
        """(under the lock) An idle uploader whose every job was adopted starts from the
        manager's view: a direct durable save (made only then) may have changed it since."""
        if self._running is None and not self._jobs and not self._done:
            self.tier.view = self._main.view

    # ------------------------------------------------------------------ the uploader thread

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._jobs or self._closed:
                    self._jobs.clear()
                    self._thread = None
                    self._cond.notify_all()
                    return
                job = self._running = self._jobs.popleft()
                self._cond.notify_all()
            try:
                done = self._run(job)
            except BaseException as e:  # never lose a job's end: its waiters would hang
                done = _Done(job, self.tier.view, None, e)
            with self._cond:
                self._done.append(done)
                self._running = None
                self._cond.notify_all()
            if done.error is None:
                self._superseded(job.step)
            elif isinstance(done.error, CorruptCheckpointError):
                self._local.owed.discard(job.step)  # it can never be uploaded from here
            else:
                self._failed_steps.add(job.step)

    def _superseded(self, step: int) -> None:
        """``step`` reached the durable tier: it and the failed uploads before it are owed no
        more (local retention may delete them)."""
        old = {s for s in self._failed_steps if s <= step}
        self._failed_steps -= old
        self._local.owed.difference_update({step, *old})

    def _run(self, job: UploadJob) -> _Done:
        """(uploader thread, collective) One job, tried up to ``tries`` times."""
        err: BaseException | None = None
        for attempt in range(self.tries):
            self._overwriting = False
            result: DurableOutcome | None = None
            try:
                result = self._try(job)
                err = None
            except Exception as e:
                err = e
            # Every rank takes the same decision: the try failed if it failed anywhere.
            try:
                failed = self.comm.any(err is not None)
            except Exception as e:
                return _Done(job, self.tier.view, None, err or e, self._overwriting)
            if not failed:
                if result is None:
                    log.info("step %d: the durable tier holds it already; not uploaded", job.step)
                elif self._on_commit is not None:
                    self._on_commit(job, result)
                return _Done(job, self.tier.view, result, None, self._overwriting)
            if err is None:
                err = SaveError(f"the durable copy of step {job.step} failed on another rank",
                                step=job.step)
            if isinstance(err, _FINAL) or attempt + 1 == self.tries:
                log.error("the durable copy of step %d failed (try %d of %d): %s", job.step,
                          attempt + 1, self.tries, err)
                return _Done(job, self.tier.view, None, err, self._overwriting)
            wait = self.retry_s * 2 ** attempt
            log.warning("the durable copy of step %d failed (try %d of %d), trying again in "
                        "%.1f s: %s", job.step, attempt + 1, self.tries, wait, err)
            time.sleep(wait)
        raise AssertionError("unreachable")

    def _try(self, job: UploadJob) -> DurableOutcome | None:
        """(uploader thread, collective) Read this rank's part (agreed), plan on the
        coordinator, write and commit; None when the root holds the step already."""
        comm = self.comm
        comm.arrivals.begin("save", job.step, "read")
        flat, maps, record = comm.agree(partial(self._read, job.step), token=job.step)
        saves = comm.all_gather(record["save"])
        if len(set(saves)) != 1:
            raise CorruptCheckpointError(
                f"the ranks hold different saves of local step {job.step} ({saves}); it is "
                "not uploaded", step=job.step)
        plan = comm.on_coordinator(partial(
            self.tier.begin, job.step, forced=False, world_size=comm.world_size,
            metrics=record["metrics"], metadata=record["metadata"], mesh=record["mesh"],
            on_exists="raise"))
        if plan is None:
            return None
        self._overwriting = plan.overwrite
        try:
            return self.tier.save(flat, plan, comm, spmd=False, trusted=record["trusted"])
        finally:
            del flat, maps  # the maps close once the writer dropped its views

    def _read(self, step: int) -> tuple[dict[str, Any], list[Any], dict[str, Any]]:
        """(every rank) This rank's part of ``step`` and what its local manifest records."""
        source, step_dir = self._local.upload_source(step)
        m = source.manifest
        record = m.metadata.get(UPLOAD_KEY) or {}
        layout = m.metadata.get(LAYOUT_KEY) or {}
        flat, maps = mapped_state(source, step_dir)
        return flat, maps, {
            "save": layout.get("save"), "metrics": dict(m.metrics),
            "metadata": {k: v for k, v in m.metadata.items() if k not in (LAYOUT_KEY, UPLOAD_KEY)},
            "mesh": record.get("mesh"), "trusted": bool(record.get("trusted", False))}

    # --------------------------------------------------------------------- the caller's side

    def owed_at_start(self, caller: Comm) -> list[int]:
        """(collective over ``caller``, constructor) Queue the whole local steps due on the
        durable tier that it lacks and that are newer than its newest step (an upload a
        restart interrupted, or a preemption's durable save the grace period did not allow),
        where every rank holds its own copy of the agreed save (an upload reads no replica,
        nor a stale node's copy of another save). Returns them.

        A rank that cannot read its copy now (an I/O error, not a finding) cannot tell: the
        step is queued when some rank finds it due and none finds otherwise (a missing or
        damaged part, another save, another root, not due); its copy reads every byte again
        and, failing, leaves it owed. So are the steps not whole only because a rank could not
        read its part when the tier opened (:meth:`LocalTier.upload_candidates`). A step left
        out here is owed nothing: local retention deletes it at the next save.

        When a step queued here is newer than every listed step (neither tier lists it), this
        waits for the copies (:meth:`drain`) before it returns: the step is then listed (the
        durable tier's), or its copy failed (raised by the next ``join``)."""
        view = self._main.view  # agreed
        newest = max(view.records, default=-1)
        due: list[int] = []
        refused: list[int] = []
        unsure: list[int] = []
        for s in self._local.upload_candidates():
            if s <= newest or view.holds(s):
                continue
            try:
                source, _ = self._local.upload_source(s, agreed=True)
            except Exception as e:  # the ranks agree below
                if is_read_failure(e):
                    log.warning("local step %d: this rank cannot read its copy now (%s); it is "
                                "copied if the other ranks find it due", s, e)
                    unsure.append(s)
                else:
                    log.info("local step %d is not uploaded from this rank: %s", s, e)
                    refused.append(s)
                continue
            # Another job's root (a new run given the same local_path) is never written to: a
            # step of another root is not a candidate (nor read: upload_source refuses it).
            other = self._local.other_root(source.manifest)
            if other is not None:
                log.info("local step %d is due on another root (%s), not %s: not uploaded", s,
                         other, self._main.url)
            if other is None and isinstance(source.manifest.metadata.get(UPLOAD_KEY), dict):
                due.append(s)
            else:
                refused.append(s)
        told = caller.all_gather((due, refused, unsure))
        no = {s for _, r, _ in told for s in r}
        steps = sorted({s for d, _, _ in told for s in d} - no)
        # No rank could tell (every read failed): not copied (it may not be due), but kept
        # from local retention as a failed copy is, until a newer step reaches the durable
        # tier or a restart looks again.
        for s in sorted({s for _, _, u in told for s in u} - no - set(steps)):
            log.warning("local step %d: no rank can read its copy now; it is kept on the local "
                        "tier until a newer step reaches the durable tier %s, or a restart "
                        "copies it", s, self._main.url)
            self._local.owed.add(s)
            self._failed_steps.add(s)
        for s in steps:
            log.info("local step %d is due on the durable tier %s and missing there: uploading "
                     "it in the background", s, self._main.url)
            self.submit(UploadJob(s), wait_for_slot=False)
        # A step newer than every step listed (either tier) is the one a resuming job must
        # find: not listed from the local tier (in doubt, or dropped), it would be listed only
        # once its copy is adopted, so restore_latest() would start the job from an older step
        # (or from scratch, and its saves would then meet the old run's steps). The constructor
        # waits for the copies (every rank alike: ``steps`` and both listings are agreed).
        view = self._main.view
        listed = max({*view.records, *view.foreign, *self._local.steps}, default=-1)
        if steps and steps[-1] > listed:
            log.info("local step %d is newer than every listed step and listed only once its "
                     "durable copy is made: waiting for it", steps[-1])
            self.drain(caller)
        return steps

    def adopt(self, caller: Comm) -> None:
        """(collective over ``caller`` when jobs were given since the last adoption; alike on
        every rank) Make the jobs finished on every rank the manager's: its durable view
        becomes the view after the last of them; their failures are kept for :meth:`failure`."""
        with self._cond:
            pending = self._submitted - self._adopted
        if not pending:
            return
        with self._cond:
            mine = len(self._done)
        n = min(caller.all_gather(mine))
        if not n:
            return
        with self._cond:
            taken, self._done = self._done[:n], self._done[n:]
            self._adopted += n
            for _ in range(n):
                self._unadopted.popleft()
        self._main.view = taken[-1].view
        for d in taken:
            if d.error is not None:
                self._failed.append(d)
                if d.overwrite:
                    # The local tier holds the new version, the root the old one: one step, two
                    # versions; the local copy goes (every rank alike: the failure is agreed).
                    self._local.forget(d.job.step)

    def pending(self, step: int) -> bool:
        """Whether a job of ``step`` was given and not adopted yet (alike on every rank right
        after :meth:`adopt`, with no save in flight): the root may or may not hold that step
        now, so a save of it waits for the job (:meth:`drain`) before it is planned."""
        with self._cond:
            return step in self._unadopted

    def pin(self, step: int) -> bool:
        """(the save worker, before the local write of ``step`` that the uploader will copy)
        Keep ``step`` from local retention from now on: the local save's own retention runs
        before :meth:`submit` and would delete a step older than the newest kept ones. Returns
        whether it was owed already (see :meth:`unpin`)."""
        owed = step in self._local.owed
        self._local.owed.add(step)
        return owed

    def unpin(self, step: int, was_owed: bool) -> None:
        """The local write :meth:`pin` prepared for failed: ``step`` is owed no more unless it
        was before."""
        if not was_owed:
            self._local.owed.discard(step)

    def superseded(self, step: int) -> None:
        """(after a direct durable commit of ``step``) The failed uploads of ``step`` and older
        steps are owed no more."""
        self._superseded(step)

    def drain(self, caller: Comm) -> None:
        """(collective over ``caller``) Wait for every job on this rank, then :meth:`adopt`."""
        with self._cond:
            while self._running is not None or self._jobs:
                self._cond.wait()
        self.adopt(caller)

    def failure(self) -> tuple[int, BaseException] | None:
        """The first adopted failure not yet raised (step, error), once; later ones are logged."""
        if not self._failed:
            return None
        first, rest = self._failed[0], self._failed[1:]
        self._failed = []
        for d in rest:
            log.error("the durable copy of step %d also failed: %s", d.job.step, d.error)
        assert first.error is not None
        return first.job.step, first.error

    def close(self) -> None:
        """No job starts from now on; waits for the one in flight (its group is destroyed next,
        by the caller, and the writer lease released: neither may go from under it). Normally
        nothing runs by now (``close()`` drained first); a constructor that failed, or a join
        that raised before it drained, may leave one."""
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._cond.notify_all()
            while self._running is not None:
                self._cond.wait()
