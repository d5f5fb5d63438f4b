"""The step store: the one place that lists, reads, commits and deletes step directories.

Every step directory of a root goes through :class:`StepStore`: the manager, every CLI command
and the importer. It knows three kinds of step directory (``<root>/<step>/``):

- **committed**: holds our manifest ``commit.json`` (a step is committed exactly then);
- **foreign DCP**: no manifest, but a plain-DCP ``.metadata`` (torch_xla's manager, torchtitan,
  ``dcp.save``): listed and restorable with ``trusted=True``, never written, never deleted;
- **uncommitted**: neither. It is a *leftover* of a crashed save only when every file in it has a
  name ckptmgr writes; anything else makes it **foreign** and it is left alone and reported.

Rules it enforces: a manifest is sized before it is read and every path in it stays inside the
step directory; a step is deleted manifest first, then only the files ckptmgr wrote (a foreign file
in a committed step survives); a directory or object ckptmgr did not write is never deleted,
renamed or written into; a due save of an existing step is skipped, a forced one is refused
(:class:`~ckptmgr.errors.CheckpointExistsError`) unless it is our committed step and overwrite
is on.

It also serves a **checkpoint directory** on its own: one step's files straight in a directory
(or the storage root itself, ``dirname=""``) with no root around it, which is what the standalone
DCP writer and reader (``ckptmgr.dcp.CkptStorageWriter(url)``) write and read:
:meth:`StepStore.begin_dir_save`, :meth:`StepStore.read_dir_manifest`,
:meth:`StepStore.read_dir_file`, then the same :meth:`StepStore.commit`.

**One door for deletions.** Everything ckptmgr removes under a root (retention, leftovers of
crashed saves, replaced attempts, failed attempts, ``prune``, the local tier) goes through
:meth:`StepStore._remove`, which runs the store's ``fence`` first: the root's writer lease is
checked (read from storage) right before each removal, so a writer that lost its lease removes
nothing. A store without a fence (a reader, the CLI's read-only commands) removes nothing either;
the standalone DCP writer, which writes a directory its caller owns and has no lease, passes
:func:`unfenced` explicitly. ``tests/project/test_house.py`` fails if anything else deletes.

Call order of one save (DESIGN.md section 5): (coordinator) :meth:`StepStore.begin_save` ->
(all ranks) write data files into ``plan.write_dir`` -> (coordinator) :meth:`StepStore.commit`
(or :meth:`StepStore.discard` after a failure) -> (coordinator)
:meth:`StepStore.remove_replaced_attempts` and retention's :meth:`StepStore.delete_step`.
"""

from __future__ import annotations

import contextvars
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptmgr.codec.checksum import checksum
from ckptmgr.codec.layout import (
    MANIFEST_NAME,
    SHARED_DIR,
    check_step,
    is_shared_chunk_name,
    is_shared_temp_name,
    join,
    new_attempt_id,
    parse_staging_name,
    parse_step_name,
    staging_dir_name,
    step_dir_name,
)
from ckptmgr.codec.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    UnsafePathError,
    decode_manifest,
    encode_manifest,
)
from ckptmgr.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptmgrError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LeaseError,
    RestoreError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptmgr.policy import StepRecord
from ckptmgr.storage import AtomicRename, Storage, is_not_found

if TYPE_CHECKING:
    from ckptmgr.codec.metadata import MetadataDoc

__all__ = [
    "DCP_METADATA_NAME",
    "CommitPlan",
    "RootScan",
    "StepFiles",
    "StepStore",
    "deleted_while_read",
    "is_attempt_file_name",
    "is_our_file_name",
    "unfenced",
]

log = logging.getLogger("ckptmgr")

_REMOVERS = 8  # unreferenced shared chunks removed at once

DCP_METADATA_NAME = ".metadata"
"""The file whose presence makes a directory a plain-DCP checkpoint (DCP's own commit point)."""



def is_our_file_name(name: str) -> bool:
    """Whether ``name`` is exactly a file name ckptmgr writes inside a step directory: the
    manifest, or a file of one attempt (``data-train.csv`` is not)."""
    return name == MANIFEST_NAME or is_attempt_file_name(name)


# A data or metadata file of one attempt (12 hex digits, then '-' or '.'), or a manifest being
# written: what a save into a user's directory may remove when it replaces an older attempt.
_ATTEMPT_FILE_RE = re.compile(r"(?:data|metadata)-[0-9a-f]{12}[-.].*|"
                              + re.escape(MANIFEST_NAME) + r"\.tmp-.*", re.DOTALL)


def is_attempt_file_name(name: str) -> bool:
    """Whether ``name`` is, exactly, the name of a file one save attempt writes (the manifest
    aside; ``data-train.csv`` is not)."""
    return _ATTEMPT_FILE_RE.fullmatch(name) is not None


@dataclass(frozen=True)
class CommitPlan:
    """What the coordinator decided for one save attempt (broadcast to every rank)."""

    step: int
    attempt: str
    write_dir: str
    step_dir: str
    staged: bool
    overwrite: bool
    world_size: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    mesh: Any = None
    reuse: Mapping[str, tuple[int, str | None]] | None = None
    """``reuse_unchanged=True``: the shared chunks this save may reference instead of writing,
    digest -> (size, checksum when the newest committed step lists it, else None), as the
    coordinator listed them when the save began (none is removed while a save is in flight);
    None: reuse is off, every byte goes into the step directory."""


@dataclass(frozen=True)
class RootScan:
    """One listing of a root, classified.

    Attributes:
        committed: steps with our manifest, ascending.
        dcp_steps: steps written by plain DCP (``.metadata``, no manifest of ours), ascending.
        uncommitted: step directory names with neither (leftovers or foreign: see
            :meth:`StepStore.is_ours`).
        staging: staging directory names of saves that never renamed into place.
        symlinks: step-named entries that are symbolic links (never followed).
        shared_dir: whether the root holds a ``chunks/`` directory (shared chunks of steps
            saved with ``reuse_unchanged=True``).
    """

    committed: list[int]
    dcp_steps: list[int]
    uncommitted: list[str]
    staging: list[str]
    symlinks: list[str]
    shared_dir: bool = False


@dataclass(frozen=True)
class StepFiles:
    """What a restore reads of a committed step besides its data (:meth:`StepStore.read_step`).

    Attributes:
        manifest: the validated manifest.
        metadata: the decoded DCP metadata (torch-free).
        sizes: the step directory's listing, file name -> bytes (read once: the data files are
            checked against it, not listed again).
    """

    manifest: Manifest
    metadata: MetadataDoc
    sizes: dict[str, int]


def unfenced() -> None:
    """The fence of a writer without a lease by design: the standalone DCP writer
    (``ckptmgr.dcp.CkptStorageWriter(url)`` under plain ``dcp.save``), whose caller owns the
    directory and runs one writer. It lets removals of that writer's own replaced and failed
    attempts through; nothing else may use it."""


class StepStore:
    """The step directories of one root.

    Reads are safe from any rank. Writes (:meth:`begin_save`, :meth:`commit`, :meth:`discard`,
    :meth:`delete_step`, :meth:`remove_leftovers`) are the coordinator's, under the root's writer
    lease (:mod:`ckptmgr.lease`), which ``fence`` checks.

    Args:
        storage: the root.
        fence: called right before every commit and every removal; raises (LeaseError) to stop
            it. None (readers): this store removes nothing and commits only with a fence
            passed to :meth:`commit`.
    """

    def __init__(self, storage: Storage, *, fence: Callable[[], None] | None = None) -> None:
        self.storage = storage
        self.fence = fence

    def _remove(self, path: str, *, recursive: bool = False) -> None:
        """The one door for removing anything under the root: the fence first, then the removal.

        Raises:
            LeaseError: this store has no fence (a reader), or the fence says the writer lost
                the root's lease: nothing is removed.
            StorageError: the removal failed.
        """
        if self.fence is None:
            raise LeaseError(f"{self.url}: this store holds no writer lease, so it removes "
                             f"nothing ({path or 'the root'} stays); open the root as its writer "
                             "to delete")
        self.fence()
        self.storage.remove(path, recursive=recursive)

    @property
    def url(self) -> str:
        """The root URL, credentials redacted."""
        return self.storage.url

    # --------------------------------------------------------------------------------- listing

    def scan(self) -> RootScan:
        """List and classify the root's entries: O(1) list calls on object stores.

        Raises:
            StorageError: listing failed.
        """
        committed: list[int] = []
        unmarked: dict[int, str] = {}
        staging: list[str] = []
        links: list[str] = []
        shared_dir = False
        for entry in self.storage.scan_root(MANIFEST_NAME):
            step = parse_step_name(entry.name)
            if step is None:
                if entry.is_dir and parse_staging_name(entry.name) is not None:
                    staging.append(entry.name)
                shared_dir = shared_dir or (entry.is_dir and not entry.is_symlink
                                            and entry.name == SHARED_DIR)
                continue
            if entry.is_symlink:
                links.append(entry.name)
            elif entry.is_dir and entry.has_marker:
                committed.append(step)
            elif entry.is_dir:
                unmarked[step] = entry.name
        # Unmarked directories are few (crashed or in-flight saves, foreign checkpoints): one
        # existence check each, not a second listing of the whole root.
        dcp = [s for s, name in unmarked.items()
               if self.storage.exists(join(name, DCP_METADATA_NAME))]
        for s in dcp:
            del unmarked[s]
        return RootScan(sorted(committed), sorted(dcp),
                        [unmarked[s] for s in sorted(unmarked)], sorted(staging), sorted(links),
                        shared_dir)

    def committed_steps(self) -> list[int]:
        """Steps with our manifest, ascending."""
        return self.scan().committed

    def records(self, steps: Iterable[int], *, read_manifests: bool) -> dict[int, StepRecord]:
        """Retention's view of committed ``steps``: with time and metrics from each manifest
        when ``read_manifests`` (an unreadable one gets time NaN: no time-based policy keeps or
        anchors on it, step-based ones still apply), else step numbers only."""
        records: dict[int, StepRecord] = {}
        for s in steps:
            records[s] = StepRecord(step=s, time=0.0)
            if not read_manifests:
                continue
            try:
                m = self.read_manifest(s)
            except CkptmgrError as e:
                log.warning("step %d: unreadable manifest (%s)", s, e)
                records[s] = StepRecord(step=s, time=float("nan"))
                continue
            records[s] = StepRecord(step=s, time=m.unix_time, metrics=dict(m.metrics))
        return records

    def _entries(self, dirname: str) -> tuple[dict[str, int], list[str]]:
        """The files of ``dirname`` and everything else in it (sub-directories, links), which
        is never ours: ckptmgr writes only files at the top of a step directory."""
        return self.storage.list_files(dirname), [f"{d}/" for d in self.storage.list_dirs(dirname)]

    def is_ours(self, dirname: str) -> bool:
        """Whether every file in ``dirname`` has a name ckptmgr writes (else it is not ours)."""
        return not self.foreign_files(dirname)

    def foreign_files(self, dirname: str) -> list[str]:
        """The files in ``dirname`` that ckptmgr did not write, sorted."""
        files, others = self._entries(dirname)
        return sorted([*(n for n in files if not is_our_file_name(n)), *others])

    def not_found(self, step: int, available: list[int]) -> CheckpointNotFoundError:
        """The error for an unknown ``step``: IncompleteCheckpointError when its directory exists
        but never committed; both list the available steps."""
        shown = available if len(available) <= 20 else [*available[:5], "...", *available[-10:]]
        try:
            leftover = self.storage.exists(step_dir_name(step))
        except StorageError:
            leftover = False
        if leftover:
            return IncompleteCheckpointError(
                f"step {step} exists but never committed in {self.url} (no {MANIFEST_NAME}); "
                f"available steps: {shown}", step=step, available=available)
        return CheckpointNotFoundError(
            f"step {step} is not a committed checkpoint in {self.url}; available steps: {shown}",
            step=step, available=available)

    def resolve(self, step: Any | None, available: list[int] | None = None) -> int:
        """``step`` if it is in ``available`` (default: the committed steps); None: the newest.

        Raises:
            ConfigError: ``step`` is not a step number.
            CheckpointNotFoundError: no such step (IncompleteCheckpointError if uncommitted).
        """
        steps = self.committed_steps() if available is None else available
        if step is None:
            if not steps:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.url}",
                                              available=[])
            return steps[-1]
        step = check_step(step)
        if step not in steps:
            raise self.not_found(step, steps)
        return step

    # --------------------------------------------------------------------------------- reading

    def check_not_symlink(self, step: int) -> None:
        """Raise UnsafeCheckpointError if the step directory is a symbolic link."""
        if self.storage.is_symlink(step_dir_name(step)):
            raise UnsafeCheckpointError(
                f"step directory {step} in {self.url} is a symbolic link; ckptmgr never follows "
                "links out of the root (replace it with a real directory)", step=step)

    def read_manifest_bytes(self, step: int) -> tuple[Manifest, bytes]:
        """The validated manifest of ``step`` and its raw bytes.

        Raises:
            CheckpointNotFoundError: no manifest (never committed, or deleted meanwhile).
            CorruptCheckpointError: oversized, unparsable or inconsistent manifest.
            UnsafeCheckpointError: a symlinked step directory or a path escaping it.
            StorageError: reading failed.
        """
        self.check_not_symlink(step)
        try:
            return self._read_manifest_at(step_dir_name(step), step)
        except StorageError as e:
            if is_not_found(e):
                raise self.not_found(step, self.committed_steps()) from e
            raise

    def read_dir_manifest(self, dirname: str = "") -> tuple[Manifest, bytes]:
        """The validated manifest of the checkpoint directory ``dirname`` ("": the storage root
        itself) and its raw bytes; its step is whatever the manifest says.

        Raises:
            CheckpointNotFoundError: no manifest there; the message says what the directory
                holds instead (a plain-DCP checkpoint, a ckptmgr root with steps, nothing).
            CorruptCheckpointError, UnsafeCheckpointError, StorageError: as
                :meth:`read_manifest_bytes`.
        """
        try:
            return self._read_manifest_at(dirname, None)
        except StorageError as e:
            if is_not_found(e):
                raise self._dir_not_found(dirname) from e
            raise

    def _dir_not_found(self, dirname: str) -> CheckpointNotFoundError:
        where = f"{self.url}/{dirname}" if dirname else self.url
        files: dict[str, int] = {}
        steps: list[int] = []
        try:
            files = self.storage.list_files(dirname)
            if not dirname and not files:  # the root of a manager holds directories only
                steps = self.committed_steps()
        except StorageError:
            pass
        if DCP_METADATA_NAME in files:
            return CheckpointNotFoundError(
                f"{where} holds a plain-DCP checkpoint (.metadata), not one written by ckptmgr: "
                "read it with torch.distributed.checkpoint.FileSystemReader (its metadata is "
                "pickle: only if you trust who wrote it), or bring it in with `ckptmgr import`",
                available=[])
        if steps:
            shown = steps if len(steps) <= 10 else [*steps[:3], "...", *steps[-5:]]
            return CheckpointNotFoundError(
                f"{where} is a ckptmgr root holding steps {shown}, not one checkpoint: pass the "
                f"step's directory (e.g. {where.rstrip('/')}/{steps[-1]})", available=steps)
        what = "it is empty or missing" if not files else f"{MANIFEST_NAME} is missing"
        return CheckpointNotFoundError(
            f"no committed checkpoint at {where} ({what}: never saved, or the save did not "
            "finish)", available=[])

    def _read_manifest_at(self, sdir: str, step: int | None) -> tuple[Manifest, bytes]:
        path = join(sdir, MANIFEST_NAME)
        what = f"step {step}: " if step is not None else ""
        # Sized first: an oversized manifest is refused without reading it.
        size = self.storage.size(path)
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(
                f"{what}{MANIFEST_NAME}: manifest is {size} bytes, over the "
                f"{MAX_MANIFEST_BYTES} limit", step=step, path=MANIFEST_NAME)
        data = self.storage.read_bytes(path)
        try:
            return decode_manifest(data, expected_step=step), data
        except UnsafePathError as e:
            raise UnsafeCheckpointError(f"{what}{MANIFEST_NAME}: {e}", step=step) from e
        except ManifestError as e:
            raise CorruptCheckpointError(f"{what}{MANIFEST_NAME}: {e}", step=step,
                                         path=MANIFEST_NAME) from e

    def read_manifest(self, step: int) -> Manifest:
        """The validated manifest of ``step`` (see :meth:`read_manifest_bytes`)."""
        return self.read_manifest_bytes(step)[0]

    def read_file(self, step: int, manifest: Manifest, name: str, *, max_bytes: int,
                  verify: bool = True) -> bytes:
        """The whole of small file ``name`` of committed ``step``, checked against the manifest.

        The size is checked before reading (a file larger than the manifest says, or than
        ``max_bytes``, is never read); the checksum after, unless ``verify`` is False (the
        manager's ``verify=False``: the size is still checked, as it bounds what is read).

        Raises:
            CorruptCheckpointError: missing, wrong size or checksum (names the file).
            UnsafeCheckpointError: the file is a symbolic link.
        """
        return self.read_dir_file(step_dir_name(step), manifest, name, max_bytes=max_bytes,
                                  verify=verify)

    def read_dir_file(self, dirname: str, manifest: Manifest, name: str, *, max_bytes: int,
                      verify: bool = True) -> bytes:
        """:meth:`read_file` for the checkpoint directory ``dirname`` (a step directory, or ""
        for the storage root itself); errors name ``manifest.step``."""
        step = manifest.step
        entry = manifest.file(name)
        path = join(dirname, name)
        if self.storage.is_symlink(path):
            raise UnsafeCheckpointError(
                f"step {step}: {name} is a symbolic link; ckptmgr never follows links out of the "
                "step directory", step=step)
        try:
            size = self.storage.size(path)
            if size != entry.size or size > max_bytes:
                raise CorruptCheckpointError(
                    f"step {step}: {name}: size is {size} bytes, the manifest says {entry.size}"
                    + (f" (limit {max_bytes})" if size > max_bytes else ""), step=step, path=name)
            data = self.storage.read_bytes(path)
        except StorageError as e:
            if is_not_found(e):
                raise CorruptCheckpointError(f"step {step}: {name}: file is missing", step=step,
                                             path=name) from e
            raise
        if len(data) != entry.size or (verify and checksum(data) != entry.checksum):
            raise CorruptCheckpointError(
                f"step {step}: {name}: size or checksum does not match the manifest", step=step,
                path=name)
        return data

    def read_metadata(self, dirname: str, manifest: Manifest, *,
                      verify: bool = True) -> MetadataDoc:
        """The decoded DCP metadata of the committed checkpoint in ``dirname`` (a step
        directory, or "" for the storage root itself): size-checked before reading,
        checksum-checked after (``verify``), decoded from JSON (never pickle); torch-free.

        Raises:
            CorruptCheckpointError, UnsafeCheckpointError: as :meth:`read_dir_file`, or
                metadata that does not decode (names the file).
        """
        # Here, not at the top: the metadata codec's checks use numpy, which ``ckptmgr ls``
        # (manifests only) never loads.
        from ckptmgr.codec.metadata_file import MAX_METADATA_BYTES, parse_metadata

        step, name = manifest.step, manifest.metadata_file
        data = self.read_dir_file(dirname, manifest, name, max_bytes=MAX_METADATA_BYTES,
                                  verify=verify)
        try:
            return parse_metadata(data)
        except UnsafePathError as e:
            raise UnsafeCheckpointError(f"step {step}: {name}: {e}", step=step) from e
        except ManifestError as e:
            raise CorruptCheckpointError(f"step {step}: {name}: {e}", step=step,
                                         path=name) from e

    def read_step(self, step: int, *, verify: bool = True) -> StepFiles:
        """Read and check committed ``step``'s manifest and metadata, and list its files once:
        everything a restore reads besides the data (one rank reads it; torch-free).

        Raises:
            CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError: as
                :meth:`read_manifest_bytes` and :meth:`read_metadata`.
            RestoreError: a step written on a host of the other byte order.
        """
        manifest = self.read_manifest(step)
        if manifest.byteorder != sys.byteorder:
            raise RestoreError(f"step {step} was written on a {manifest.byteorder}-endian host; "
                               f"this host is {sys.byteorder}-endian", step=step)
        sdir = step_dir_name(step)
        metadata = self.read_metadata(sdir, manifest, verify=verify)
        sizes = self.storage.list_files(sdir)
        if manifest.shared:
            sizes.update(self.shared_sizes())
        return StepFiles(manifest, metadata, sizes)

    def shared_sizes(self) -> dict[str, int]:
        """The shared chunks of the root as listed now: ``chunks/<hex>`` -> bytes (one list
        call; files under ``chunks/`` with other names are left out)."""
        if self.storage.is_symlink(SHARED_DIR):
            return {}  # never followed: every chunk a step names is then missing
        return {join(SHARED_DIR, name): size
                for name, size in self.storage.list_files(SHARED_DIR).items()
                if is_shared_chunk_name(name)}

    def current_attempt(self, step: int) -> str | None:
        """The attempt id of ``step``'s manifest now, None if absent or unreadable."""
        try:
            return self.read_manifest(step).attempt
        except (CkptmgrError, StorageError):
            return None

    # ---------------------------------------------------------------------------------- saving

    def begin_save(self, step: int, *, forced: bool, overwrite: bool, world_size: int,
                   metrics: Mapping[str, float] | None = None,
                   metadata: Mapping[str, Any] | None = None, mesh: Any = None,
                   on_exists: str = "raise", attempt: str | None = None) -> CommitPlan | None:
        """(coordinator, under the lease) Decide where a save of ``step`` writes, from what the
        root holds now (never from a cached list).

        - absent: a new attempt (staged under a temporary name where the storage renames);
        - our leftover of a crashed save: removed, then as absent;
        - our committed step: overwritten with ``overwrite``; else a due save is skipped (None,
          one warning) and a forced one is CheckpointExistsError;
        - a foreign directory (a plain-DCP step, or files we did not write): a due save is
          skipped (None, one warning); a forced one is CheckpointExistsError, even with
          ``overwrite``: ckptmgr never writes into what it did not write.

        Args:
            on_exists: "raise" (the rules above for forced saves) or "skip" (always skip an
                existing step: preemption saves, which must not fail).
            attempt: the attempt id (default: a fresh one); a copy keeps its source's, since
                its file names carry it.

        Returns:
            The plan, or None when the save is skipped.
        """
        admitted = self.admits_save(step, forced=forced, overwrite=overwrite,
                                    on_exists=on_exists)
        if admitted is None:
            return None
        sdir, files, committed = admitted
        attempt = attempt or new_attempt_id()
        staged = isinstance(self.storage, AtomicRename) and not committed
        if staged:
            if files or self.storage.exists(sdir):
                # Our own leftover of a crashed save of this very step blocks the rename.
                log.info("removing uncommitted leftover %s/%s (only ckptmgr's files)", self.url,
                         sdir)
                self._remove(sdir, recursive=True)
            write_dir = staging_dir_name(step, attempt)
        else:
            write_dir = sdir
        self.storage.makedirs(write_dir)
        return CommitPlan(step=step, attempt=attempt, write_dir=write_dir, step_dir=sdir,
                          staged=staged, overwrite=committed, world_size=world_size,
                          metrics=dict(metrics or {}), metadata=dict(metadata or {}), mesh=mesh)

    def begin_dir_save(self, dirname: str = "", *, step: int, world_size: int,
                       attempt: str | None = None) -> CommitPlan:
        """(coordinator) Plan a save into the checkpoint directory ``dirname`` ("": the storage
        root itself), written in place: the new attempt's files go next to whatever is there,
        and its manifest, written last, is the commit (replacing an older one of ours at once,
        whose files :meth:`remove_replaced_attempts` then removes).

        Unlike :meth:`begin_save` the directory is the caller's: files ckptmgr did not write may
        sit in it and are left alone, but a plain-DCP checkpoint (``.metadata``) is refused, as
        our files next to it would leave a directory that two readers see differently.

        Raises:
            CheckpointExistsError: the directory holds a plain-DCP checkpoint.
            UnsafeCheckpointError: ``dirname`` is a symbolic link (not for the root itself).
            StorageError: listing or creating the directory failed.
        """
        if dirname and self.storage.is_symlink(dirname):
            raise UnsafeCheckpointError(f"{self.url}/{dirname} is a symbolic link; ckptmgr "
                                        "never writes through links", step=step)
        files = self.storage.list_files(dirname)
        if DCP_METADATA_NAME in files:
            where = f"{self.url}/{dirname}" if dirname else self.url
            raise CheckpointExistsError(
                f"{where} holds a plain-DCP checkpoint (.metadata); ckptmgr never writes into "
                "or deletes what it did not write: save to another directory, or move it away")
        attempt = attempt or new_attempt_id()
        self.storage.makedirs(dirname)
        return CommitPlan(step=step, attempt=attempt, write_dir=dirname, step_dir=dirname,
                          staged=False, overwrite=MANIFEST_NAME in files, world_size=world_size)

    def admits_save(self, step: int, *, forced: bool, overwrite: bool, on_exists: str = "raise"
                    ) -> tuple[str, dict[str, int], bool] | None:
        """(coordinator) :meth:`begin_save`'s decision alone, changing nothing: None when the
        save of ``step`` is skipped (one warning), else its directory, the files there and
        whether it is committed. A save whose durable part is planned later (a copy made from
        the local tier) is admitted or refused by this when it is called, as a direct one is.

        Raises:
            CheckpointExistsError: as :meth:`begin_save`, for a forced save.
        """
        sdir = step_dir_name(step)
        if self.storage.is_symlink(sdir):
            self._refuse(step, forced and on_exists == "raise",
                         f"step directory {sdir} in {self.url} is a symbolic link")
            return None
        files, others = self._entries(sdir)
        committed = MANIFEST_NAME in files
        foreign = sorted([*(n for n in files if not is_our_file_name(n)), *others])
        if foreign:
            what = ("a plain-DCP checkpoint (.metadata)" if DCP_METADATA_NAME in foreign
                    else f"files ckptmgr did not write ({', '.join(foreign[:5])})")
            self._refuse(
                step, forced and on_exists == "raise",
                f"step {step} in {self.url} holds {what}; ckptmgr never writes into or deletes "
                "what it did not write: move those files away, or save under another root or "
                "step")
            return None
        if committed and not overwrite:
            self._refuse(
                step, forced and on_exists == "raise",
                f"step {step} is already committed in {self.url}; pass overwrite=True to "
                "replace it, or save another step")
            return None
        return sdir, files, committed

    def _refuse(self, step: int, raise_it: bool, message: str) -> None:
        if raise_it:
            raise CheckpointExistsError(message)
        log.warning("skipping the save of step %d: %s", step, message)

    def commit(self, plan: CommitPlan, manifest: Manifest | bytes,
               fence: Callable[[], None] | None = None) -> None:
        """(coordinator, after every rank's files are durable) Make ``plan``'s step visible.

        Staged: the manifest goes into the staging directory, which is fsynced and renamed into
        place, then the root is fsynced. Direct (object stores, overwrite): the step directory is
        fsynced, then the manifest is written in one atomic put (exclusive unless overwriting).
        ``fence`` (default: the store's) runs right before the step becomes visible and raises
        to stop it (a writer that lost its lease). ``manifest`` may be encoded already (a copy
        keeps its bytes).
        """
        data = manifest if isinstance(manifest, bytes) else encode_manifest(manifest)
        storage = self.storage
        fence = fence if fence is not None else self.fence
        if plan.staged:
            assert isinstance(storage, AtomicRename), "a staged plan on a storage without rename"
            storage.write_bytes(join(plan.write_dir, MANIFEST_NAME), data)
            storage.fsync_dir(plan.write_dir)
            if fence is not None:
                fence()
            storage.rename(plan.write_dir, plan.step_dir)
            storage.fsync_dir("")
        else:
            if isinstance(storage, AtomicRename):
                storage.fsync_dir(plan.step_dir)  # the new attempt's files, before the manifest
            if fence is not None:
                fence()
            self.storage.write_bytes(join(plan.step_dir, MANIFEST_NAME), data,
                                     exclusive=not plan.overwrite)
        log.debug("committed step %d (attempt %s) at %s", plan.step, plan.attempt, self.url)

    def discard(self, plan: CommitPlan) -> None:
        """(coordinator) Remove what a failed attempt wrote; never a committed manifest's files.
        Best effort: a failure is logged, not raised; a writer that lost its lease removes
        nothing (the next holder removes the leftover)."""
        try:
            if plan.staged:
                self._remove(plan.write_dir, recursive=True)
                return
            try:
                committed = self._read_manifest_at(plan.step_dir, None)[0].attempt
            except (CkptmgrError, StorageError):
                committed = None
            if committed == plan.attempt:
                return  # it committed after all
            for name in self.storage.list_files(plan.step_dir):
                if plan.attempt in name and is_our_file_name(name):
                    self._remove(join(plan.step_dir, name))
            # An emptied step directory goes; a checkpoint directory (begin_dir_save) is the
            # caller's and stays.
            if plan.step_dir and not plan.overwrite and not self.storage.list_files(
                    plan.step_dir):
                self._remove(plan.step_dir, recursive=True)
        except (StorageError, CkptmgrError) as e:
            log.warning("could not remove files of failed attempt %s of step %d: %s",
                        plan.attempt, plan.step, e)

    def remove_replaced_attempts(self, plan: CommitPlan) -> None:
        """(coordinator, after a direct commit) Remove our files of other attempts of the step:
        those an overwrite replaced and those of crashed attempts (exact attempt-file names
        only, so a caller's own files beside them stay). Best effort; a writer that lost its
        lease removes nothing."""
        try:
            for name in self.storage.list_files(plan.step_dir):
                if plan.attempt not in name and is_attempt_file_name(name):
                    self._remove(join(plan.step_dir, name))
        except (StorageError, CkptmgrError) as e:
            log.warning("could not remove files replaced by the save of step %d: %s",
                        plan.step, e)

    # -------------------------------------------------------------------------------- deleting

    def delete_step(self, step: int) -> None:
        """(coordinator, under the lease) Delete our committed ``step``: the manifest first (the
        step is then no longer listed), then the files ckptmgr wrote; files it did not write
        stay, with their directory.

        Raises:
            LeaseError: this writer does not hold the root's lease (nothing removed).
            StorageError: removing the manifest failed (the step is still committed). Later
                failures are logged: the step is already uncommitted.
        """
        sdir = step_dir_name(step)
        if self.storage.is_symlink(sdir):
            raise UnsafeCheckpointError(f"step directory {step} in {self.url} is a symbolic "
                                        "link; not deleting through it", step=step)
        self._remove(join(sdir, MANIFEST_NAME))
        try:
            self._remove_our_dir(sdir)
        except (StorageError, LeaseError) as e:
            log.warning("step %d is uncommitted but its files remain: %s", step, e)

    def _remove_our_dir(self, dirname: str) -> None:
        foreign = self.foreign_files(dirname)
        if not foreign:
            self._remove(dirname, recursive=True)
            return
        for name in self.storage.list_files(dirname):
            if is_our_file_name(name):
                self._remove(join(dirname, name))
        log.warning("%s/%s: left %d files ckptmgr did not write: %s", self.url, dirname,
                    len(foreign), ", ".join(foreign[:5]))

    def remove_unreferenced_chunks(self, *, dry_run: bool = False) -> list[str]:
        """(coordinator, under the lease, with no save in flight) Remove every shared chunk that
        no committed step references, and the temporary files of chunk writes that never
        finished. Decided from the committed manifests alone, read now: a chunk is kept while
        any committed step's manifest lists it; a step whose manifest cannot be read stops the
        whole clean-up (it might reference any chunk). Files under ``chunks/`` whose names are
        not a chunk's are never touched.

        Nothing else may write the root meanwhile: the manager runs it after its save committed
        (the only save in flight), the CLI under the writer lease. A crash at any point leaves at
        worst unreferenced chunks, which the next call removes.

        Returns:
            The paths removed (``dry_run``: that would be removed).

        Raises:
            LeaseError: this writer does not hold the root's lease (nothing more removed).
            StorageError: listing the root or ``chunks/`` failed (nothing removed).
        """
        if self.storage.is_symlink(SHARED_DIR):
            log.warning("%s/%s is a symbolic link; ckptmgr never removes through links",
                        self.url, SHARED_DIR)
            return []
        listed = self.storage.list_files(SHARED_DIR)
        if not listed:
            return []
        referenced: set[str] = set()
        for step in self.committed_steps():
            try:
                referenced.update(f.path for f in self.read_manifest(step).shared)
            except CheckpointNotFoundError:
                continue  # uncommitted meanwhile: it references nothing any more
            except CkptmgrError as e:
                log.warning("no shared chunk removed from %s: the manifest of step %d cannot be "
                            "read (%s), so any chunk may be one of its own", self.url, step, e)
                return []
        doomed = [join(SHARED_DIR, name) for name in sorted(listed)
                  if (is_shared_chunk_name(name) or is_shared_temp_name(name))
                  and join(SHARED_DIR, name) not in referenced]
        if dry_run or not doomed:
            return doomed

        def sweep_one(path: str) -> bool:
            try:
                self._remove(path)  # fenced, each: a lost lease stops the rest
            except StorageError as e:
                log.warning("could not remove unreferenced shared chunk %s: %s", path, e)
                return False
            return True

        # Side by side: one unlink took ~2 ms here (a file system mounted with discard), one
        # after the other a retention of 1 GiB of chunks took longer than writing them.
        done = _in_threads(sweep_one, doomed, _REMOVERS, name="ckptmgr-sweep")
        removed = [p for p, ok in zip(doomed, done, strict=True) if ok]
        if removed:
            log.info("removed %d unreferenced shared chunks from %s", len(removed), self.url)
        return removed

    def remove_leftovers(self, scan: RootScan, *, keep_attempt: str | None = None,
                         protect: Iterable[int] = ()) -> list[str]:
        """(coordinator, under the lease: no other writer is in flight) Remove leftovers of
        crashed saves that are provably ours: staging directories (except ``keep_attempt``'s)
        and step directories without a manifest holding only files ckptmgr writes (except
        ``protect``). Foreign directories are reported in the log and left alone. Best effort
        for each entry, except that a lost lease stops it at once.

        Returns:
            The names removed.

        Raises:
            LeaseError: this writer does not hold the root's lease (nothing more removed).
        """
        keep = set(protect)
        removed: list[str] = []
        for name in [*scan.staging, *scan.uncommitted]:
            staged = parse_staging_name(name)
            step = staged[0] if staged is not None else parse_step_name(name)
            if (staged is not None and staged[1] == keep_attempt) or step in keep:
                continue
            try:
                if self.remove_leftover(name):
                    removed.append(name)
            except StorageError as e:
                log.warning("could not remove leftover %s: %s", name, e)
        return removed

    def remove_leftover(self, name: str, *, dry_run: bool = False) -> bool:
        """(under the lease) Remove one uncommitted entry if it is provably ours: a staging
        directory, or a step directory without a manifest holding only ckptmgr's file names.

        Returns:
            Whether it was ours (and, unless ``dry_run``, removed). Foreign ones are logged.

        Raises:
            LeaseError: this writer does not hold the root's lease (nothing removed).
            StorageError: listing or removing failed.
        """
        if parse_staging_name(name) is None and not self.is_ours(name):
            log.warning("%s/%s has no manifest but holds files ckptmgr did not write; leaving it",
                        self.url, name)
            return False
        if not dry_run:
            log.info("removing leftover of a crashed save: %s/%s", self.url, name)
            self._remove(name, recursive=True)
        return True


def _in_threads(fn: Callable[[str], bool], items: list[str], num: int, *,
                name: str) -> list[bool]:
    """``[fn(x) for x in items]`` on up to ``num`` threads (each in a copy of the caller's
    context: its retry budget). Plain threads, not ``concurrent.futures``: this may run while
    the interpreter exits. The first exception stops the rest and is raised."""
    out = [False] * len(items)
    todo = iter(range(len(items)))
    lock = threading.Lock()
    failures: list[BaseException] = []

    def work() -> None:
        while True:
            with lock:
                i = None if failures else next(todo, None)
            if i is None:
                return
            try:
                out[i] = fn(items[i])
            except BaseException as e:
                with lock:
                    failures.append(e)

    threads = [threading.Thread(target=contextvars.copy_context().run, args=(work,),
                                name=f"{name}-{k}", daemon=True)
               for k in range(min(num, len(items)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return out


def deleted_while_read(store: StepStore, step: int,
                       attempt: str | None = None) -> CheckpointNotFoundError | None:
    """(coordinator, after a read of committed ``step`` failed) The error that says the step was
    deleted while it was read (its manifest is gone: retention of the job writing the root, or a
    prune), or replaced by another save attempt than ``attempt``; None when the step still holds
    what was read (then the failure is the step's own: damage, or an I/O error).

    A reader racing retention meets files that vanish under it ("No such file"); that is no
    damage and no I/O failure: the step simply no longer exists.
    """
    try:
        current: str | None = store.read_manifest(step).attempt
    except CheckpointNotFoundError:  # the manifest is gone (IncompleteCheckpointError too)
        current = None
    except CkptmgrError:  # unreadable now, or storage failing: keep the original error
        return None
    if current is not None and (attempt is None or current == attempt):
        return None
    try:
        available = store.committed_steps()
    except CkptmgrError:
        available = []
    shown = available if len(available) <= 20 else [*available[:5], "...", *available[-10:]]
    what = ("deleted (by the retention of the job writing this root, or a prune)"
            if current is None else "replaced (overwritten by the job writing this root)")
    return CheckpointNotFoundError(
        f"step {step} was {what} while it was being read from {store.url}; it is not damaged: "
        f"restore another step (or read it again); available steps: {shown}",
        step=step, available=available)
