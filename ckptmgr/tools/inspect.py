"""The read-only commands: list a root's steps, inspect one step, verify steps' bytes.

Nothing here writes. Damage found by :func:`verify_steps` is reported in its result, not raised.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptmgr.codec.checksum import Hasher
from ckptmgr.codec.layout import (
    MANIFEST_NAME,
    check_step,
    is_shared_chunk_path,
    step_dir_name,
)
from ckptmgr.codec.manifest import FileEntry
from ckptmgr.errors import (
    CheckpointNotFoundError,
    CkptmgrError,
    CorruptCheckpointError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptmgr.info import StepInfo
from ckptmgr.progress import Progress, phase
from ckptmgr.step_store import StepStore, deleted_while_read
from ckptmgr.storage import Storage, is_not_found, open_storage
from ckptmgr.tools._common import (
    _CHUNK,
    DigestCheck,
    _element_size,
    _file_sizes,
    _locations,
    _natural,
    _numel,
    stored_path,
)
from ckptmgr.tools.listing import StepListing, list_steps

if TYPE_CHECKING:
    from ckptmgr.codec.metadata import ItemLocation

__all__ = [
    "Problem",
    "StepDetails",
    "StepListing",
    "StepVerification",
    "TensorEntry",
    "ValueEntry",
    "inspect_step",
    "list_steps",
    "verify_steps",
]

log = logging.getLogger("ckptmgr")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a step: its global shape and how it is stored.

    Attributes:
        name: the flat key (state-dict path joined with '.').
        dtype: e.g. ``"float32"``.
        shape: the global shape.
        nbytes: bytes of the whole tensor.
        chunks: ``(offsets, sizes)`` of each stored chunk (one per shard; one for a whole tensor).
        shared_bytes: bytes of its chunks stored in shared chunks of the root
            (``reuse_unchanged=True``); the rest is in the step's own data files.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    shared_bytes: int = 0

    @property
    def sharding(self) -> str:
        """``"whole"``, or ``"<n> chunks"`` with the chunk shape when all are alike."""
        if len(self.chunks) == 1 and self.chunks[0][1] == self.shape:
            return "whole"
        sizes = {c[1] for c in self.chunks}
        if len(sizes) == 1:
            return f"{len(self.chunks)} chunks of {list(next(iter(sizes)))}"
        return f"{len(self.chunks)} chunks"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "bytes": self.nbytes, "sharding": self.sharding,
                "chunks": [{"offsets": list(o), "sizes": list(s)} for o, s in self.chunks],
                "shared_bytes": self.shared_bytes}


@dataclass(frozen=True)
class ValueEntry:
    """One Python value of a step (stored as tagged JSON, or pickle when saved trusted)."""

    name: str
    encoding: str
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"name": self.name, "encoding": self.encoding, "bytes": self.nbytes}


@dataclass(frozen=True)
class StepDetails:
    """What :func:`inspect_step` found: the manifest and every stored item.

    Attributes:
        url: the root URL (credentials redacted).
        info: the manifest as a :class:`~ckptmgr.info.StepInfo`.
        attempt: the save attempt token of the committed files.
        metadata_file: the JSON metadata file's name.
        tensors: every tensor, by name.
        values: every Python value, by name.
        shared: the shared chunks the step references (``reuse_unchanged=True``; path
            ``chunks/<32 hex>`` relative to the root, size, checksum); empty for a step that
            holds all its bytes in its own directory.
    """

    url: str
    info: StepInfo
    attempt: str
    metadata_file: str
    tensors: tuple[TensorEntry, ...]
    values: tuple[ValueEntry, ...]
    shared: tuple[FileEntry, ...] = ()

    @property
    def shared_bytes(self) -> int:
        """Bytes of the shared chunks the step references (its own are ``info.total_bytes``)."""
        return sum(f.size for f in self.shared)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the ``inspect --json`` document)."""
        i = self.info
        return {
            "url": self.url, "step": i.step,
            "manifest": {
                "time": i.time, "attempt": self.attempt, "world_size": i.world_size,
                "mesh": i.mesh, "versions": dict(i.versions), "metrics": dict(i.metrics),
                "metadata": dict(i.metadata), "metadata_file": self.metadata_file,
                "files": [{"path": f.path, "size": f.size, "checksum": f.checksum}
                          for f in i.files],
                "bytes_per_rank": {str(r): b for r, b in sorted(i.bytes_per_rank.items())},
                "total_bytes": i.total_bytes,
                "shared": [{"path": f.path, "size": f.size, "checksum": f.checksum}
                           for f in self.shared],
                "shared_bytes": self.shared_bytes,
            },
            "tensors": [t.to_json() for t in self.tensors],
            "values": [v.to_json() for v in self.values],
        }


def inspect_step(url: str, step: int | None = None, *,
                 storage_options: Mapping[str, Any] | None = None) -> StepDetails:
    """The manifest and the stored tensors and values of committed ``step`` (None: the newest).

    Reads the manifest and the metadata file (checked against the manifest); no data file.

    Raises:
        CheckpointNotFoundError: ``step`` is not committed (IncompleteCheckpointError when it
            exists but never committed); lists the available steps.
            Also when the step was deleted (or replaced) while it was read.
        CorruptCheckpointError: the manifest or metadata does not parse or does not match.
    """
    storage = open_storage(url, storage_options, writable=False)
    store = StepStore(storage)
    step = store.resolve(step)
    manifest, _ = store.read_manifest_bytes(step)
    try:
        md = store.read_metadata(step_dir_name(step), manifest)
    except (CorruptCheckpointError, StorageError) as e:
        gone = deleted_while_read(store, step, manifest.attempt)
        if gone is not None:  # retention of a job writing the root: not damage
            raise gone from e
        raise
    tensors: list[TensorEntry] = []
    values: list[ValueEntry] = []
    in_shared: dict[str, int] = {}  # tensor -> bytes of its chunks in shared chunks
    if manifest.shared:
        for fqn, offsets, where in md.locations():
            if offsets is not None and is_shared_chunk_path(where.file):
                in_shared[fqn] = in_shared.get(fqn, 0) + where.length
    for name in sorted([*md.tensors, *md.values], key=_natural):
        t = md.tensors.get(name)
        if t is not None:
            tensors.append(TensorEntry(name, t.dtype, t.size,
                                       _numel(t.size) * _element_size(t.dtype), tuple(t.chunks),
                                       in_shared.get(name, 0)))
        else:
            loc = md.location(name, None)
            values.append(ValueEntry(name, loc.enc if loc else "?", loc.length if loc else 0))
    return StepDetails(storage.url, StepInfo.from_manifest(manifest), manifest.attempt,
                       manifest.metadata_file, tuple(tensors), tuple(values),
                       tuple(manifest.shared))


@dataclass(frozen=True)
class Problem:
    """One damaged file of a step: its path relative to the step directory and what is wrong."""

    path: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"path": self.path, "reason": self.reason}


@dataclass(frozen=True)
class StepVerification:
    """The result of re-reading one step.

    Attributes:
        step: the step.
        files_checked: files of the step directory whose bytes were read and hashed.
        bytes_checked: bytes read for this step (its files, and the shared chunks no earlier
            step of the same run had read).
        problems: every damaged file, with the reason; empty when the step is intact. A
            damaged shared chunk (path ``chunks/<32 hex>``, relative to the root) is reported
            against every step that references it.
        shared_chunks: shared chunks the step references (``reuse_unchanged=True``); each is
            checked (exists, size, checksum, content matching its name, item checksums).
        shared_bytes: their bytes.
        shared_checked_before: how many of them an earlier step of the same run had checked
            already (not read again; their verdict is repeated here).
    """

    step: int
    files_checked: int
    bytes_checked: int
    problems: tuple[Problem, ...]
    shared_chunks: int = 0
    shared_bytes: int = 0
    shared_checked_before: int = 0

    @property
    def ok(self) -> bool:
        """Whether the step is intact."""
        return not self.problems

    @property
    def corrupt_files(self) -> list[str]:
        """Paths of the damaged files, each once: relative to the step directory, or to the
        root for a shared chunk (``chunks/<32 hex>``)."""
        return sorted({p.path for p in self.problems})

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"step": self.step, "ok": self.ok, "files_checked": self.files_checked,
                "bytes_checked": self.bytes_checked, "corrupt_files": self.corrupt_files,
                "problems": [p.to_json() for p in self.problems],
                "shared_chunks": self.shared_chunks, "shared_bytes": self.shared_bytes,
                "shared_checked_before": self.shared_checked_before}


# Problems that mean "a file is gone": damage, unless the whole step went (deleted_while_read).
_CHUNK_MISSING = "shared chunk is missing"
_VANISHED = frozenset({"file is missing", "file disappeared while being read", _CHUNK_MISSING})


class _RangeHashes:
    """Checksums of several byte ranges of one file, fed with the file's chunks in order."""

    def __init__(self, items: list[tuple[str, ItemLocation]]) -> None:
        self.items = sorted(items, key=lambda it: (it[1].offset, it[1].length))
        self.hashers = [Hasher() for _ in self.items]
        self._first = 0  # items before this index ended before the last chunk

    def update(self, start: int, data: memoryview) -> None:
        end = start + len(data)
        i = self._first
        while i < len(self.items) and self.items[i][1].offset < end:
            loc = self.items[i][1]
            a, b = max(start, loc.offset), min(end, loc.offset + loc.length)
            if a < b:
                self.hashers[i].update(data[a - start:b - start])
            i += 1
        while (self._first < len(self.items)
               and self.items[self._first][1].offset + self.items[self._first][1].length <= end):
            self._first += 1

    def mismatches(self) -> list[str]:
        return [name for (name, loc), h in zip(self.items, self.hashers, strict=True)
                if h.value() != loc.checksum]


@dataclass
class _ChunkVerdict:
    """What re-reading one shared chunk found: kept for the run, so a chunk that several steps
    reference is read once and its damage reported against each of them."""

    reasons: list[str]
    ranges: set[tuple[int, int, str]]  # (offset, length, checksum) of the items checked there
    nbytes: int  # bytes read


class _SharedChunks:
    """The shared chunks of one root during one verify run: listed once, each read once."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._sizes: dict[str, int] | None = None
        self.verdicts: dict[str, _ChunkVerdict] = {}

    def sizes(self) -> dict[str, int]:
        if self._sizes is None:
            self._sizes = StepStore(self.storage).shared_sizes()
        return self._sizes


def _read_and_hash(storage: Storage, path: str, size: int, buf: bytearray, p: Progress,
                   ranges: _RangeHashes, digest: DigestCheck | None) -> tuple[str, int]:
    """(whole-file checksum, bytes read) of ``path``, its item ranges fed on the way.

    Raises:
        StorageError: reading failed (not-found: the file disappeared while being read).
    """
    hasher = Hasher()
    pos = 0
    while pos < size:
        n = min(len(buf), size - pos)
        view = memoryview(buf)[:n]
        storage.read_into(path, pos, view)
        hasher.update(view)
        ranges.update(pos, view)
        if digest is not None:
            digest.update(view)
        pos += n
        p.advance(n)
    return hasher.value(), pos


def _verify_one(storage: Storage, step: int, p: Progress,
                shared: _SharedChunks | None = None) -> StepVerification:
    """Re-read ``step``; raises CheckpointNotFoundError when it was deleted (or replaced) while
    it was read: that is not damage. ``shared``: the run's shared chunks (a chunk another step
    of the run referenced is not read again)."""
    sdir = step_dir_name(step)
    shared = shared if shared is not None else _SharedChunks(storage)
    try:
        manifest, _ = StepStore(storage).read_manifest_bytes(step)
    except (CorruptCheckpointError, UnsafeCheckpointError) as e:
        # A manifest naming a path outside the step (``../../etc/passwd``) is damage too.
        return StepVerification(step, 0, 0, (Problem(MANIFEST_NAME, str(e)),))
    problems: list[Problem] = []
    entries = [*manifest.files, *manifest.shared]
    sizes = _file_sizes(storage, sdir, [f.path for f in manifest.files])
    if manifest.shared:
        chunk_sizes = shared.sizes()
        sizes.update({f.path: chunk_sizes.get(f.path) for f in manifest.shared})
    readable = []
    for f in entries:
        actual = sizes[f.path]
        if actual is None:
            problems.append(Problem(f.path, _CHUNK_MISSING if is_shared_chunk_path(f.path)
                                    else "file is missing"))
        elif actual != f.size:
            problems.append(Problem(f.path, f"size is {actual} bytes, the manifest says {f.size}"))
        else:
            readable.append(f)
    # Per-item ranges, from the metadata, when it is intact (else only whole-file checks).
    by_file: dict[str, list[tuple[str, ItemLocation]]] = {}
    md_name = manifest.metadata_file
    if not any(pr.path == md_name for pr in problems):
        try:
            md = StepStore(storage).read_metadata(sdir, manifest)
        except (CorruptCheckpointError, UnsafeCheckpointError) as e:
            problems.append(Problem(md_name, str(e).split(": ", 2)[-1]))
        else:
            listed = {f.path: f.size for f in entries}
            for (fqn, _off), loc in _locations(md).items():
                if loc.file not in listed:
                    problems.append(Problem(md_name, f"{fqn!r} is stored in {loc.file!r}, which "
                                                     "the manifest does not list"))
                elif loc.offset + loc.length > listed[loc.file]:
                    problems.append(Problem(loc.file, f"{fqn!r} lies beyond the end of the file"))
                else:
                    by_file.setdefault(loc.file, []).append((fqn, loc))
    nbytes = 0
    files_checked = 0
    cached = 0
    buf = bytearray(min(_CHUNK, max((f.size for f in readable), default=0)))
    for f in readable:
        items = by_file.get(f.path, [])
        is_shared = is_shared_chunk_path(f.path)
        if is_shared:
            seen = shared.verdicts.get(f.path)
            want = {(loc.offset, loc.length, loc.checksum) for _, loc in items}
            if seen is not None and want <= seen.ranges:
                cached += 1
                problems.extend(Problem(f.path, r) for r in seen.reasons)
                continue
        else:
            files_checked += 1
        # A shared chunk holds one item, all of it, whose checksum is the chunk's own: the
        # whole-file check is that item's check, so its bytes are not hashed a second time.
        whole = [(name, loc) for name, loc in items
                 if (loc.offset, loc.length, loc.checksum) == (0, f.size, f.checksum)]
        ranges = _RangeHashes([it for it in items if it not in whole])
        digest = DigestCheck(f.path) if is_shared else None
        try:
            value, n = _read_and_hash(storage, stored_path(sdir, f.path), f.size, buf, p,
                                      ranges, digest)
        except StorageError as e:
            if not is_not_found(e):
                raise  # an I/O failure is an error, not a verdict on the checkpoint
            problems.append(Problem(f.path, "file disappeared while being read"))
            continue
        nbytes += n
        reasons: list[str] = []
        if value != f.checksum:
            reasons.append(f"checksum is {value}, the manifest says {f.checksum}")
        elif digest is not None and (wrong := digest.mismatch()) is not None:
            reasons.append(wrong)
        bad = ranges.mismatches()
        if value != f.checksum:  # the items that span the whole file are damaged with it
            bad = [*(name for name, _ in whole), *bad]
        if bad:
            shown = ", ".join(repr(b) for b in bad[:5]) + (", ..." if len(bad) > 5 else "")
            reasons.append(f"item checksum mismatch in {shown}")
        problems.extend(Problem(f.path, r) for r in reasons)
        if is_shared:
            good = {(loc.offset, loc.length, loc.checksum) for _, loc in items} if not bad else (
                set())
            shared.verdicts[f.path] = _ChunkVerdict(reasons, good, n)
    if any(pr.reason in _VANISHED for pr in problems):
        gone = deleted_while_read(StepStore(storage), step, manifest.attempt)
        if gone is not None:  # retention of a job writing the root: not damage
            raise gone
    # A damaged chunk is kept in the run's verdicts only by its reasons, so the next step that
    # references it reports it too (its ranges are re-checked when they differ).
    return StepVerification(step, files_checked, nbytes, tuple(problems),
                            shared_chunks=len(manifest.shared),
                            shared_bytes=manifest.shared_bytes, shared_checked_before=cached)


def verify_steps(url: str, steps: Sequence[int | None] | None = None, *, all_steps: bool = False,
                 storage_options: Mapping[str, Any] | None = None,
                 progress: Progress | None = None) -> list[StepVerification]:
    """Re-read every file of the given committed steps and check sizes and checksums.

    Checks, per step: the manifest parses; every file it lists exists with its size; the whole
    file's xxh3_64 matches the manifest; the metadata parses and each stored item (tensor chunk or
    value) lies inside its file and matches its own checksum. Files are read once, in
    ``16 MiB`` pieces.

    The shared chunks a step references (``reuse_unchanged=True``: ``chunks/<32 hex>`` under the
    root) are checked like its own files, and also that their bytes hash (xxh3-128) to their
    name. A chunk several of the steps reference is read once per call; its damage is reported
    in the result of every step that references it.

    Args:
        url: the root.
        steps: the steps to check (None in it: the newest committed step); None with
            ``all_steps=False``: the newest committed step.
        all_steps: check every committed step.
        storage_options: fsspec options of the root.
        progress: receives the bytes read.

    Returns:
        One :class:`StepVerification` per step, ascending; damage is reported there, not raised.
        With ``all_steps``, a step deleted while it was read (retention of a job writing the
        root) is left out (logged): it is no longer a committed step.

    Raises:
        CheckpointNotFoundError: a requested step is not committed (or none is, for the default),
            or was deleted (or replaced) while it was read.
        StorageError: reading failed for a reason other than damage.
    """
    storage = open_storage(url, storage_options, writable=False)
    available = StepStore(storage).committed_steps()
    if all_steps:
        chosen = available
    elif steps is None:
        chosen = [StepStore(storage).resolve(None)]
    else:
        chosen = []
        for s in steps:
            if s is None:  # "latest"
                s = StepStore(storage).resolve(None)
            s = check_step(s)
            if s not in available:
                raise StepStore(storage).not_found(s, available)
            chosen.append(s)
        chosen = sorted(set(chosen))
    total = 0
    chunks: dict[str, int] = {}  # a chunk several steps reference is read once
    for s in chosen:
        with contextlib.suppress(CkptmgrError):
            m = StepStore(storage).read_manifest_bytes(s)[0]
            total += m.total_bytes
            chunks.update((f.path, f.size) for f in m.shared)
    total += sum(chunks.values())
    results: list[StepVerification] = []
    shared = _SharedChunks(storage)
    with phase(progress, total, "verify") as p:
        for s in chosen:
            try:
                results.append(_verify_one(storage, s, p, shared))
            except CheckpointNotFoundError as e:
                if not all_steps:
                    raise
                log.warning("verify: %s", e)  # no longer committed: nothing to verify
    return results
