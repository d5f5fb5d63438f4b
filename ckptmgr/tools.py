"""Operator tools over a checkpoint root: list, inspect, verify, prune, export, copy and import.

These are the library functions behind the ``ckptmgr`` command line (see ``docs/cli.md``); each
can be called from Python too::

    from ckptmgr import tools

    for s in tools.list_steps("gs://bucket/run-7"):
        print(s.step, s.committed, s.total_bytes)
    report = tools.verify_steps("/ckpt/run-7", all_steps=True)
    tools.export_step("/ckpt/run-7", 1000, "model.safetensors", only="model", dtype="bf16")
    tools.import_dcp("/ckpt/dcp-run/step-500", "/ckpt/run-7", 500, trusted=True)

Every function is local (no process group) and works on any storage the library supports. They
read manifests and metadata as the manager does: JSON only, every path checked to stay inside its
step directory; only :func:`import_dcp` runs pickle (DCP's own ``.metadata``), and only with
``trusted=True``. Errors are :class:`~ckptmgr.errors.CkptmgrError` subclasses naming the step and
the file.

What they must not break (DESIGN.md sections 5 and 7):
- :func:`prune_steps` uses the library's retention policies and never deletes the newest committed
  step; a step is deleted manifest first, then its files.
- :func:`copy_steps` and :func:`import_dcp` write a step's files first and its manifest last (a
  staging directory renamed into place on POSIX, the manifest object written last on object
  stores), so a crash leaves an uncommitted leftover, never a listed step with missing files.
- Nothing here holds more than about the largest tensor (export, import) or one read buffer
  (verify, copy) in memory.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import pickle
import struct
import sys
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ckptmgr.dcp._bytes import Hasher, checksum, tensor_memoryview
from ckptmgr.dcp._compat import dcp_load, dcp_save
from ckptmgr.dcp._metadata_json import ItemLocation, decode_metadata, dtype_name
from ckptmgr.dcp.planner import CkptSavePlanner
from ckptmgr.dcp.state import flatten_state
from ckptmgr.dcp.writer import CkptStorageWriter, CommitPlan
from ckptmgr.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptmgrError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    SaveError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptmgr.info import StepInfo
from ckptmgr.layout import (
    MANIFEST_NAME,
    join,
    new_attempt_id,
    parse_staging_name,
    parse_step_name,
    staging_dir_name,
    step_dir_name,
)
from ckptmgr.manifest import Manifest, ManifestError, decode_manifest
from ckptmgr.policy import StepRecord, build_policy, steps_to_delete
from ckptmgr.storage import Storage, is_not_found, open_storage, redact_url

__all__ = [
    "CopyResult",
    "ExportResult",
    "Problem",
    "Progress",
    "PruneResult",
    "StepDetails",
    "StepListing",
    "StepVerification",
    "TensorEntry",
    "ValueEntry",
    "copy_steps",
    "export_step",
    "format_bytes",
    "import_dcp",
    "inspect_step",
    "list_steps",
    "prune_steps",
    "verify_steps",
]

_CHUNK = 16 * 1024 * 1024  # read buffer of verify and copy
_IMPORT_BATCH = 256 * 1024 * 1024  # tensors loaded per DCP read during import (at least one)


class Progress(Protocol):
    """Receives progress of a long operation (the CLI draws a bar on a terminal)."""

    def start(self, total: int, label: str) -> None:
        """A new phase of ``total`` bytes begins."""

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more bytes were processed."""

    def finish(self) -> None:
        """The phase ended (successfully or not)."""


class _NoProgress:
    def start(self, total: int, label: str) -> None:
        return None

    def advance(self, nbytes: int) -> None:
        return None

    def finish(self) -> None:
        return None


@contextlib.contextmanager
def _phase(progress: Progress | None, total: int, label: str) -> Any:
    p: Progress = progress if progress is not None else _NoProgress()
    p.start(total, label)
    try:
        yield p
    finally:
        p.finish()


# ------------------------------------------------------------------------------ shared reading


def _check_step(step: Any, what: str = "step") -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"{what} must be an int >= 0, got {step!r}")
    return step


def _committed(storage: Storage) -> list[int]:
    steps = []
    for entry in storage.scan_root(MANIFEST_NAME):
        step = parse_step_name(entry.name)
        if step is not None and entry.is_dir and not entry.is_symlink and entry.has_marker:
            steps.append(step)
    return sorted(steps)


def _not_found(storage: Storage, step: int, available: list[int]) -> CheckpointNotFoundError:
    shown = ", ".join(map(str, available[-20:])) or "none"
    if len(available) > 20:
        shown = "..., " + shown
    if storage.exists(step_dir_name(step)):
        return IncompleteCheckpointError(
            f"step {step} exists but never committed in {storage.url} (no {MANIFEST_NAME}); "
            f"available steps: {shown}", step=step, available=available)
    return CheckpointNotFoundError(
        f"step {step} is not a committed checkpoint in {storage.url}; available steps: {shown}",
        step=step, available=available)


def _resolve_step(storage: Storage, step: int | None) -> int:
    """``step`` if committed (None: the newest committed step)."""
    available = _committed(storage)
    if step is None:
        if not available:
            raise CheckpointNotFoundError(f"no committed checkpoint in {storage.url}")
        return available[-1]
    step = _check_step(step)
    if step not in available:
        raise _not_found(storage, step, available)
    return step


def _read_manifest(storage: Storage, step: int) -> tuple[Manifest, bytes]:
    sdir = step_dir_name(step)
    if storage.is_symlink(sdir):
        raise UnsafeCheckpointError(
            f"step directory {step} in {storage.url} is a symlink; refusing to follow it",
            step=step)
    try:
        data = storage.read_bytes(join(sdir, MANIFEST_NAME))
    except StorageError as e:
        if is_not_found(e):
            raise _not_found(storage, step, _committed(storage)) from e
        raise
    try:
        return decode_manifest(data, expected_step=step), data
    except ManifestError as e:
        raise CorruptCheckpointError(f"step {step}: {MANIFEST_NAME}: {e}", step=step,
                                     path=MANIFEST_NAME) from e


def _read_metadata(storage: Storage, step: int, manifest: Manifest) -> Metadata:
    name = manifest.metadata_file
    entry = manifest.file(name)
    try:
        data = storage.read_bytes(join(step_dir_name(step), name))
    except StorageError as e:
        if is_not_found(e):
            raise CorruptCheckpointError(f"step {step}: {name}: file is missing", step=step,
                                         path=name) from e
        raise
    if len(data) != entry.size or checksum(data) != entry.checksum:
        raise CorruptCheckpointError(
            f"step {step}: {name}: size or checksum does not match the manifest", step=step,
            path=name)
    try:
        return decode_metadata(data)
    except ManifestError as e:
        raise CorruptCheckpointError(f"step {step}: {name}: {e}", step=step, path=name) from e


def _file_sizes(storage: Storage, step_dir: str, paths: Iterable[str]) -> dict[str, int | None]:
    """Actual sizes of ``paths`` (relative to ``step_dir``); None for a missing file."""
    listed = storage.list_files(step_dir)
    out: dict[str, int | None] = {}
    for p in paths:
        if "/" not in p:
            out[p] = listed.get(p)
            continue
        try:
            out[p] = storage.size(join(step_dir, p))
        except StorageError as e:
            if not is_not_found(e):
                raise
            out[p] = None
    return out


def _locations(md: Metadata) -> dict[tuple[str, tuple[int, ...] | None], ItemLocation]:
    out: dict[tuple[str, tuple[int, ...] | None], ItemLocation] = {}
    for idx, loc in (md.storage_data or {}).items():
        if isinstance(loc, ItemLocation):
            out[(idx.fqn, None if idx.offset is None else tuple(idx.offset))] = loc
    return out


def format_bytes(n: float) -> str:
    """``12.0 MiB``: a byte count for people (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _natural(key: str) -> list[tuple[int, int | str]]:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in key.split(".")]


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ----------------------------------------------------------------------------------------- ls


@dataclass(frozen=True)
class StepListing:
    """One entry of a root: a committed step or the leftover of a save that never committed.

    Attributes:
        name: the directory (prefix) name under the root: ``"100"``, or ``".tmp-100-<attempt>"``
            for the staging directory of a save that crashed before its rename.
        step: the step number.
        committed: whether ``<name>/commit.json`` exists (a step is committed exactly then).
        status: ``"committed"``, ``"incomplete"`` (no manifest: a crashed or in-flight save) or
            ``"unreadable"`` (a manifest that does not parse; restore would refuse it).
        time: commit time (UTC ISO 8601), None unless the manifest was read.
        total_bytes: bytes of the step's files (manifest's sum, else the listed files).
        world_size: ranks that saved it, when known.
        metrics: the metrics saved with it.
        error: why the manifest is unreadable, else None.
    """

    name: str
    step: int
    committed: bool
    status: str
    time: str | None
    total_bytes: int
    world_size: int | None
    metrics: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the ``ls --json`` object)."""
        return {"step": self.step, "name": self.name, "committed": self.committed,
                "status": self.status, "time": self.time, "total_bytes": self.total_bytes,
                "world_size": self.world_size, "metrics": dict(self.metrics),
                "error": self.error}


def list_steps(url: str, *, storage_options: Mapping[str, Any] | None = None) -> list[StepListing]:
    """Every committed step of the root at ``url`` and every leftover of a save that never
    committed, ascending by step.

    Reads each committed step's manifest (for time, size and metrics); lists each leftover's files.
    A root that does not exist is empty. Symlinked entries and names ckptmgr does not write are
    skipped.

    Raises:
        ConfigError, BackendNotInstalledError: a bad URL (see :func:`ckptmgr.storage.open_storage`).
        StorageError: listing or reading failed.
    """
    storage = open_storage(url, storage_options)
    out: list[StepListing] = []
    for entry in storage.scan_root(MANIFEST_NAME):
        if entry.is_symlink or not entry.is_dir:
            continue
        step = parse_step_name(entry.name)
        staged = parse_staging_name(entry.name)
        if step is not None and entry.has_marker:
            try:
                m, _ = _read_manifest(storage, step)
            except CorruptCheckpointError as e:
                size = sum(storage.list_files(entry.name).values())
                out.append(StepListing(entry.name, step, True, "unreadable", None, size, None,
                                       {}, str(e)))
                continue
            out.append(StepListing(entry.name, step, True, "committed", m.time, m.total_bytes,
                                   m.world_size, dict(m.metrics)))
        elif step is not None or staged is not None:
            s = step if step is not None else staged[0]  # type: ignore[index]
            size = sum(storage.list_files(entry.name).values())
            out.append(StepListing(entry.name, s, False, "incomplete", None, size, None))
    out.sort(key=lambda s: (s.step, not s.committed, s.name))
    return out


# ------------------------------------------------------------------------------------ inspect


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a step: its global shape and how it is stored.

    Attributes:
        name: the flat key (state-dict path joined with '.').
        dtype: e.g. ``"float32"``.
        shape: the global shape.
        nbytes: bytes of the whole tensor.
        chunks: ``(offsets, sizes)`` of each stored chunk (one per shard; one for a whole tensor).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]

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
                "chunks": [{"offsets": list(o), "sizes": list(s)} for o, s in self.chunks]}


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
    """

    url: str
    info: StepInfo
    attempt: str
    metadata_file: str
    tensors: tuple[TensorEntry, ...]
    values: tuple[ValueEntry, ...]

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
        CorruptCheckpointError: the manifest or metadata does not parse or does not match.
    """
    storage = open_storage(url, storage_options)
    step = _resolve_step(storage, step)
    manifest, _ = _read_manifest(storage, step)
    md = _read_metadata(storage, step, manifest)
    locs = _locations(md)
    tensors: list[TensorEntry] = []
    values: list[ValueEntry] = []
    for name in sorted(md.state_dict_metadata, key=_natural):
        sm = md.state_dict_metadata[name]
        if isinstance(sm, TensorStorageMetadata):
            shape = tuple(int(s) for s in sm.size)
            chunks = tuple((tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
                           for c in sm.chunks)
            tensors.append(TensorEntry(
                name, dtype_name(sm.properties.dtype), shape,
                _numel(shape) * _element_size(sm.properties.dtype), chunks))
        else:
            loc = locs.get((name, None))
            values.append(ValueEntry(name, loc.enc if loc else "?", loc.length if loc else 0))
    return StepDetails(storage.url, StepInfo.from_manifest(manifest), manifest.attempt,
                       manifest.metadata_file, tuple(tensors), tuple(values))


# ------------------------------------------------------------------------------------- verify


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
        files_checked: files whose bytes were read and hashed.
        bytes_checked: bytes read.
        problems: every damaged file, with the reason; empty when the step is intact.
    """

    step: int
    files_checked: int
    bytes_checked: int
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        """Whether the step is intact."""
        return not self.problems

    @property
    def corrupt_files(self) -> list[str]:
        """Paths (relative to the step directory) of the damaged files, each once."""
        return sorted({p.path for p in self.problems})

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"step": self.step, "ok": self.ok, "files_checked": self.files_checked,
                "bytes_checked": self.bytes_checked, "corrupt_files": self.corrupt_files,
                "problems": [p.to_json() for p in self.problems]}


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


def _verify_one(storage: Storage, step: int, p: Progress) -> StepVerification:
    sdir = step_dir_name(step)
    try:
        manifest, _ = _read_manifest(storage, step)
    except CorruptCheckpointError as e:
        return StepVerification(step, 0, 0, (Problem(MANIFEST_NAME, str(e)),))
    problems: list[Problem] = []
    sizes = _file_sizes(storage, sdir, [f.path for f in manifest.files])
    readable = []
    for f in manifest.files:
        actual = sizes[f.path]
        if actual is None:
            problems.append(Problem(f.path, "file is missing"))
        elif actual != f.size:
            problems.append(Problem(f.path, f"size is {actual} bytes, the manifest says {f.size}"))
        else:
            readable.append(f)
    # Per-item ranges, from the metadata, when it is intact (else only whole-file checks).
    by_file: dict[str, list[tuple[str, ItemLocation]]] = {}
    md_name = manifest.metadata_file
    if not any(pr.path == md_name for pr in problems):
        try:
            md = _read_metadata(storage, step, manifest)
        except CorruptCheckpointError as e:
            problems.append(Problem(md_name, str(e).split(": ", 2)[-1]))
        else:
            listed = {f.path: f.size for f in manifest.files}
            for (fqn, _off), loc in _locations(md).items():
                if loc.file not in listed:
                    problems.append(Problem(md_name, f"{fqn!r} is stored in {loc.file!r}, which "
                                                     "the manifest does not list"))
                elif loc.offset + loc.length > listed[loc.file]:
                    problems.append(Problem(loc.file, f"{fqn!r} lies beyond the end of the file"))
                else:
                    by_file.setdefault(loc.file, []).append((fqn, loc))
    nbytes = 0
    buf = bytearray(min(_CHUNK, max((f.size for f in readable), default=0)))
    for f in readable:
        path = join(sdir, f.path)
        hasher = Hasher()
        ranges = _RangeHashes(by_file.get(f.path, []))
        pos = 0
        try:
            while pos < f.size:
                n = min(len(buf), f.size - pos)
                view = memoryview(buf)[:n]
                storage.read_into(path, pos, view)
                hasher.update(view)
                ranges.update(pos, view)
                pos += n
                nbytes += n
                p.advance(n)
        except StorageError as e:
            if not is_not_found(e):
                raise  # an I/O failure is an error, not a verdict on the checkpoint
            problems.append(Problem(f.path, "file disappeared while being read"))
            continue
        if hasher.value() != f.checksum:
            problems.append(Problem(f.path, f"checksum is {hasher.value()}, the manifest says "
                                            f"{f.checksum}"))
        bad = ranges.mismatches()
        if bad:
            shown = ", ".join(repr(b) for b in bad[:5]) + (", ..." if len(bad) > 5 else "")
            problems.append(Problem(f.path, f"item checksum mismatch in {shown}"))
    return StepVerification(step, len(readable), nbytes, tuple(problems))


def verify_steps(url: str, steps: Sequence[int | None] | None = None, *, all_steps: bool = False,
                 storage_options: Mapping[str, Any] | None = None,
                 progress: Progress | None = None) -> list[StepVerification]:
    """Re-read every file of the given committed steps and check sizes and checksums.

    Checks, per step: the manifest parses; every file it lists exists with its size; the whole
    file's xxh3_64 matches the manifest; the metadata parses and each stored item (tensor chunk or
    value) lies inside its file and matches its own checksum. Files are read once, in
    ``16 MiB`` pieces.

    Args:
        url: the root.
        steps: the steps to check (None in it: the newest committed step); None with
            ``all_steps=False``: the newest committed step.
        all_steps: check every committed step.
        storage_options: fsspec options of the root.
        progress: receives the bytes read.

    Returns:
        One :class:`StepVerification` per step, ascending; damage is reported there, not raised.

    Raises:
        CheckpointNotFoundError: a requested step is not committed (or none is, for the default).
        StorageError: reading failed for a reason other than damage.
    """
    storage = open_storage(url, storage_options)
    available = _committed(storage)
    if all_steps:
        chosen = available
    elif steps is None:
        chosen = [_resolve_step(storage, None)]
    else:
        chosen = []
        for s in steps:
            if s is None:  # "latest"
                s = _resolve_step(storage, None)
            s = _check_step(s)
            if s not in available:
                raise _not_found(storage, s, available)
            chosen.append(s)
        chosen = sorted(set(chosen))
    total = 0
    for s in chosen:
        with contextlib.suppress(CkptmgrError):
            total += _read_manifest(storage, s)[0].total_bytes
    with _phase(progress, total, "verify") as p:
        return [_verify_one(storage, s, p) for s in chosen]


# -------------------------------------------------------------------------------------- prune


@dataclass(frozen=True)
class PruneResult:
    """What :func:`prune_steps` deleted (or would delete, with ``dry_run``).

    Attributes:
        deleted: committed steps deleted, ascending.
        kept: committed steps kept, ascending.
        removed_leftovers: names of uncommitted leftovers removed.
        dry_run: True when nothing was actually deleted.
        failed: ``"<name>: <error>"`` for each deletion that failed.
        foreign_leftovers: uncommitted step directories left alone because they hold files
            ckptmgr does not write.
    """

    deleted: tuple[int, ...]
    kept: tuple[int, ...]
    removed_leftovers: tuple[str, ...]
    dry_run: bool
    failed: tuple[str, ...] = ()
    foreign_leftovers: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"dry_run": self.dry_run, "deleted": list(self.deleted), "kept": list(self.kept),
                "removed_leftovers": list(self.removed_leftovers), "failed": list(self.failed),
                "foreign_leftovers": list(self.foreign_leftovers)}


def prune_steps(url: str, *, keep_last: int | None = None, keep_every: int | None = None,
                keep_best: int | None = None, best_metric: str | None = None,
                best_mode: str = "min", incomplete: bool = False, dry_run: bool = False,
                storage_options: Mapping[str, Any] | None = None,
                log: Callable[[str], None] | None = None) -> PruneResult:
    """Delete committed steps that the retention policy does not keep, and optionally leftovers.

    The policy is the library's (:func:`ckptmgr.policy.build_policy`): the union of the newest
    ``keep_last`` steps, every step divisible by ``keep_every`` and the ``keep_best`` best steps by
    ``best_metric``; the newest committed step is never deleted. ``keep_last=None`` deletes no
    committed step (only leftovers, with ``incomplete``); ``keep_last=0`` keeps every step, as in
    the manager. A step is deleted manifest first, then its files.

    ``incomplete=True`` also removes every uncommitted leftover: staging directories of crashed
    saves, and step directories without a manifest that hold only files ckptmgr writes (others
    are left alone and reported in ``foreign_leftovers``). Do not use it while a job is saving to
    this root: its in-flight save is such a leftover until it commits.

    Args:
        log: called with one line per deletion (before it happens), e.g. ``print``.

    Raises:
        ConfigError: a bad option (the message names it).
        StorageError: listing failed. A failed deletion is reported in ``failed`` instead.
    """
    policy = build_policy(max_to_keep=keep_last or 0, keep_period=keep_every,
                          best_metric=best_metric, best_mode=best_mode, keep_best=keep_best)
    storage = open_storage(url, storage_options)
    entries = list_steps(url, storage_options=storage_options)
    records = []
    for e in entries:
        if e.committed:
            t = 0.0
            if e.time is not None:
                with contextlib.suppress(ValueError):
                    t = _unix(e.time)
            records.append(StepRecord(step=e.step, time=t, metrics=dict(e.metrics)))
    to_delete = steps_to_delete(records, policy) if keep_last is not None else []
    say = log or (lambda _line: None)
    verb = "would delete" if dry_run else "deleting"
    failed: list[str] = []
    deleted: list[int] = []
    for step in to_delete:
        say(f"{verb} step {step}")
        if dry_run:
            deleted.append(step)
            continue
        sdir = step_dir_name(step)
        try:
            storage.remove(join(sdir, MANIFEST_NAME))  # uncommit first
        except StorageError as err:
            failed.append(f"{sdir}: {err}")
            continue
        deleted.append(step)
        try:
            storage.remove(sdir, recursive=True)
        except StorageError as err:
            failed.append(f"{sdir}: uncommitted, but its files remain: {err}")
    removed: list[str] = []
    foreign: list[str] = []
    if incomplete:
        for e in entries:
            if e.committed:
                continue
            if parse_staging_name(e.name) is None and not _only_our_files(storage, e.name):
                say(f"leaving {e.name}: it holds files ckptmgr did not write")
                foreign.append(e.name)
                continue
            say(f"{'would remove' if dry_run else 'removing'} incomplete leftover {e.name}")
            if not dry_run:
                try:
                    storage.remove(e.name, recursive=True)
                except StorageError as err:
                    failed.append(f"{e.name}: {err}")
                    continue
            removed.append(e.name)
    gone = set(deleted)
    kept = tuple(r.step for r in records if r.step not in gone)
    return PruneResult(tuple(deleted), kept, tuple(removed), dry_run, tuple(failed),
                       tuple(foreign))


def _only_our_files(storage: Storage, dirname: str) -> bool:
    """Whether every file in ``dirname`` has a name ckptmgr writes (as the manager checks)."""
    names = storage.list_files(dirname)
    return all(n.startswith(("data-", "metadata-", f"{MANIFEST_NAME}.tmp-")) for n in names)


def _unix(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


# ------------------------------------------------------------------------------------- export

_SAFETENSORS_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "int32": "I32",
    "int64": "I64", "uint16": "U16", "uint32": "U32", "uint64": "U64", "float16": "F16",
    "bfloat16": "BF16", "float32": "F32", "float64": "F64", "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3", "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
}
# torch.save names a storage by its legacy class where one exists, else by the dtype itself.
_PT_STORAGE_TYPES = {
    "float32": "FloatStorage", "float64": "DoubleStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage",
    "complex64": "ComplexFloatStorage", "complex128": "ComplexDoubleStorage",
}
_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16",
    "float16": "float16", "half": "float16", "fp32": "float32", "f32": "float32",
    "float32": "float32", "float": "float32", "fp64": "float64", "f64": "float64",
    "float64": "float64", "double": "float64",
}


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_step` wrote.

    Attributes:
        path: the output file.
        format: ``"safetensors"`` or ``"pt"``.
        step: the exported step.
        num_tensors: tensors written.
        nbytes: bytes of tensor data written (the file is slightly larger).
        skipped: keys left out because they are Python values, not tensors.
    """

    path: str
    format: str
    step: int
    num_tensors: int
    nbytes: int
    skipped: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"path": self.path, "format": self.format, "step": self.step,
                "num_tensors": self.num_tensors, "bytes": self.nbytes,
                "skipped": list(self.skipped)}


def _export_format(out: str, fmt: str | None) -> str:
    if fmt is None:
        lower = out.lower()
        if lower.endswith(".safetensors"):
            return "safetensors"
        if lower.endswith((".pt", ".pth", ".bin")):
            return "pt"
        raise ConfigError(f"output {out!r} must end in .safetensors, .pt or .pth, or the "
                          "format must be given")
    if fmt not in ("safetensors", "pt"):
        raise ConfigError(f"format must be 'safetensors' or 'pt', got {fmt!r}")
    return fmt


def _cast_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = _DTYPE_ALIASES.get(str(dtype).lower())
    if name is None:
        raise ConfigError(f"dtype must be one of bf16, fp16, fp32, fp64 (or their torch names), "
                          f"got {dtype!r}")
    dt: torch.dtype = getattr(torch, name)
    return dt


@dataclass(frozen=True)
class _Planned:
    key: str  # flat key in the checkpoint
    name: str  # name in the output
    meta: TensorStorageMetadata
    out_dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.meta.size)

    @property
    def out_nbytes(self) -> int:
        return _numel(self.shape) * _element_size(self.out_dtype)


class _TensorSource:
    """Assembles whole tensors of one step from their stored chunks, verifying each chunk."""

    def __init__(self, storage: Storage, step: int, manifest: Manifest, md: Metadata) -> None:
        self.storage = storage
        self.step = step
        self.sdir = step_dir_name(step)
        self.manifest = manifest
        self.locs = _locations(md)

    def _corrupt(self, path: str, msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"step {self.step}: {path}: {msg}", step=self.step,
                                      path=path)

    def check_files(self, keys: Iterable[tuple[str, TensorStorageMetadata]]) -> None:
        """Check that every file holding a chunk of ``keys`` exists with its manifest size."""
        files = set()
        for key, meta in keys:
            for c in meta.chunks:
                if _numel(c.sizes):
                    files.add(self._loc(key, tuple(c.offsets)).file)
        listed = {f.path: f.size for f in self.manifest.files}
        sizes = _file_sizes(self.storage, self.sdir, sorted(files))
        for f in sorted(files):
            if f not in listed:
                raise self._corrupt(f, "not listed in the manifest")
            if sizes[f] is None:
                raise self._corrupt(f, "file is missing")
            if sizes[f] != listed[f]:
                raise self._corrupt(f, f"size is {sizes[f]} bytes, the manifest says {listed[f]}")

    def _loc(self, key: str, offsets: tuple[int, ...]) -> ItemLocation:
        loc = self.locs.get((key, offsets))
        if loc is None:
            raise self._corrupt(self.manifest.metadata_file,
                                f"no stored bytes for {key!r} at offsets {list(offsets)}")
        return loc

    def _read_chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                    dtype: torch.dtype) -> torch.Tensor:
        loc = self._loc(key, offsets)
        buf = torch.empty(sizes, dtype=dtype)
        view = tensor_memoryview(buf)
        if len(view) != loc.length:
            raise self._corrupt(loc.file, f"{key!r} needs {len(view)} bytes, the metadata says "
                                          f"{loc.length}")
        if len(view):
            self.storage.read_into(join(self.sdir, loc.file), loc.offset, view)
        if checksum(view) != loc.checksum:
            raise self._corrupt(loc.file, f"checksum mismatch in the bytes of {key!r}")
        return buf

    def tensor(self, key: str, meta: TensorStorageMetadata) -> torch.Tensor:
        """The whole tensor ``key`` (chunks of a sharded tensor are assembled)."""
        shape = tuple(int(s) for s in meta.size)
        dtype = meta.properties.dtype
        chunks = [(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
                  for c in meta.chunks if _numel(c.sizes) or not _numel(meta.size)]
        if len(chunks) == 1 and chunks[0][1] == shape:
            return self._read_chunk(key, chunks[0][0], shape, dtype)
        if sum(_numel(s) for _, s in chunks) != _numel(shape):
            raise self._corrupt(self.manifest.metadata_file,
                                f"the chunks of {key!r} do not cover its shape {list(shape)}")
        full = torch.empty(shape, dtype=dtype)
        for offsets, sizes in chunks:
            part = self._read_chunk(key, offsets, sizes, dtype)
            dst = full
            for dim, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
                dst = dst.narrow(dim, o, s)
            dst.copy_(part)
            del part
        return full


def _select(md: Metadata, only: str | None, cast: torch.dtype | None,
            ) -> tuple[list[_Planned], list[str]]:
    planned: list[_Planned] = []
    skipped: list[str] = []
    prefix = None if only is None else only.strip(".")
    if prefix == "":
        raise ConfigError("only must name a key prefix such as 'model', got an empty string")
    for key in sorted(md.state_dict_metadata, key=_natural):
        if prefix is not None:
            if key == prefix:
                name = key
            elif key.startswith(prefix + "."):
                name = key[len(prefix) + 1:]
            else:
                continue
        else:
            name = key
        sm = md.state_dict_metadata[key]
        if not isinstance(sm, TensorStorageMetadata):
            skipped.append(key)
            continue
        src = sm.properties.dtype
        out = cast if (cast is not None and src.is_floating_point) else src
        planned.append(_Planned(key, name, sm, out))
    if not planned:
        tops = sorted({k.split(".", 1)[0] for k, v in md.state_dict_metadata.items()
                       if isinstance(v, TensorStorageMetadata)})
        what = f"under prefix {only!r}" if only is not None else "in this step"
        raise ConfigError(f"no tensors {what}; top-level keys with tensors: {tops}")
    return planned, skipped


def _safetensors_header(planned: list[_Planned], step: int) -> bytes:
    import json

    header: dict[str, Any] = {"__metadata__": {"format": "pt", "ckptmgr_step": str(step)}}
    pos = 0
    for t in planned:
        code = _SAFETENSORS_DTYPES.get(dtype_name(t.out_dtype))
        if code is None:
            raise ConfigError(f"{t.key!r} has dtype {dtype_name(t.out_dtype)}, which safetensors "
                              "cannot store; export to .pt instead")
        header[t.name] = {"dtype": code, "shape": list(t.shape),
                          "data_offsets": [pos, pos + t.out_nbytes]}
        pos += t.out_nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _pickle_int(n: int) -> bytes:
    if 0 <= n < 256:
        return pickle.BININT1 + bytes([n])
    if -(2**31) <= n < 2**31:
        return pickle.BININT + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return pickle.LONG1 + bytes([len(raw)]) + raw


def _pickle_str(s: str) -> bytes:
    raw = s.encode("utf-8")
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _pickle_tuple(items: Sequence[int]) -> bytes:
    return pickle.MARK + b"".join(_pickle_int(i) for i in items) + pickle.TUPLE


def _pt_data_pkl(planned: list[_Planned]) -> bytes:
    """The ``data.pkl`` record torch.save writes for a dict of contiguous CPU tensors.

    Written opcode by opcode (protocol 2, as torch.save) so that no tensor has to exist in memory:
    ``{name: _rebuild_tensor_v2(<storage key i>, 0, shape, stride, False, OrderedDict())}`` with
    persistent ids ``("storage", torch.<Type>Storage, "<i>", "cpu", numel)``.
    """
    out = [pickle.PROTO + b"\x02", pickle.EMPTY_DICT, pickle.MARK]
    for i, t in enumerate(planned):
        shape = t.shape
        stride = [0] * len(shape)
        acc = 1
        for d in range(len(shape) - 1, -1, -1):
            stride[d] = acc
            acc *= shape[d]
        dname = dtype_name(t.out_dtype)
        storage_type = _PT_STORAGE_TYPES.get(dname, dname)
        out += [
            _pickle_str(t.name),
            pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n",
            pickle.MARK,
            pickle.MARK, _pickle_str("storage"),
            pickle.GLOBAL + f"torch\n{storage_type}\n".encode("ascii"),
            _pickle_str(str(i)), _pickle_str("cpu"), _pickle_int(_numel(shape)), pickle.TUPLE,
            pickle.BINPERSID,
            _pickle_int(0), _pickle_tuple(shape), _pickle_tuple(stride), pickle.NEWFALSE,
            pickle.GLOBAL + b"collections\nOrderedDict\n", pickle.EMPTY_TUPLE, pickle.REDUCE,
            pickle.TUPLE, pickle.REDUCE,
        ]
    out += [pickle.SETITEMS, pickle.STOP]
    return b"".join(out)


class _PtWriter:
    """Writes torch.save's zip layout record by record (stored, tensor data 64-byte aligned)."""

    _ALIGN = 64
    _ZIP64_LIMIT = (1 << 31) - 1

    def __init__(self, f: Any, archive: str) -> None:
        self.f = f
        self.archive = archive
        self.zf = zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True)

    def _info(self, name: str, size: int, *, align: bool) -> zipfile.ZipInfo:
        info = zipfile.ZipInfo(f"{self.archive}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        if align:
            # Pad the local header's extra field (id "FB", as torch does) so data starts aligned.
            zip64 = size * 1.05 > self._ZIP64_LIMIT
            base = self.f.tell() + 30 + len(info.filename.encode("utf-8")) + (20 if zip64 else 0)
            pad = -base % self._ALIGN
            if 0 < pad < 4:
                pad += self._ALIGN
            if pad:
                info.extra = struct.pack("<HH", 0x4246, pad - 4) + b"\0" * (pad - 4)
        return info

    def record(self, name: str, data: bytes) -> None:
        self.zf.writestr(self._info(name, len(data), align=False), data)

    def tensor_record(self, name: str, size: int) -> Any:
        return self.zf.open(self._info(name, size, align=True), "w")

    def close(self) -> None:
        self.zf.close()


def export_step(url: str, step: int | None, out: str | os.PathLike[str], *,
                only: str | None = None, dtype: str | torch.dtype | None = None,
                format: str | None = None, storage_options: Mapping[str, Any] | None = None,
                progress: Progress | None = None) -> ExportResult:
    """Write committed ``step``'s tensors into one consolidated, weights-only file.

    The output loads with plain ``safetensors.torch.load_file`` (``.safetensors``) or
    ``torch.load(path, weights_only=True)`` (``.pt``/``.pth``): a flat dict of name -> tensor.
    Tensors saved in several chunks (sharded, world size > 1) are assembled into whole tensors;
    every chunk's checksum is verified. Python values are left out (listed in ``skipped``). The
    file is written tensor by tensor into a temporary name and renamed at the end, so memory stays
    near the largest tensor and a failed export leaves no partial file.

    Args:
        url: the root.
        step: the committed step (None: the newest).
        out: a local output path; its suffix picks the format unless ``format`` is given.
        only: keep only keys under this top-level prefix (e.g. ``"model"``), named without it
            (``"model.fc.weight"`` becomes ``"fc.weight"``) so the file loads straight into the
            module.
        dtype: cast floating-point tensors to this dtype (``"bf16"``, ``"fp16"``, ``"fp32"``,
            ``"fp64"`` or a torch dtype); other tensors keep theirs.
        format: ``"safetensors"`` or ``"pt"``.
        storage_options: fsspec options of the root.
        progress: receives the bytes written.

    Raises:
        CheckpointNotFoundError: ``step`` is not committed.
        CorruptCheckpointError: a size or checksum mismatch (nothing is left at ``out``).
        ConfigError: a bad option, no tensor selected, or a dtype the format cannot store.
    """
    out = os.fspath(out)
    fmt = _export_format(out, format)
    cast = _cast_dtype(dtype)
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ConfigError(f"the output directory {parent!r} does not exist")
    storage = open_storage(url, storage_options)
    step = _resolve_step(storage, step)
    manifest, _ = _read_manifest(storage, step)
    if manifest.byteorder != sys.byteorder:
        raise ConfigError(f"step {step} was written on a {manifest.byteorder}-endian host; "
                          f"this host is {sys.byteorder}-endian")
    md = _read_metadata(storage, step, manifest)
    planned, skipped = _select(md, only, cast)
    source = _TensorSource(storage, step, manifest, md)
    source.check_files((t.key, t.meta) for t in planned)
    header = _safetensors_header(planned, step) if fmt == "safetensors" else b""
    total = sum(t.out_nbytes for t in planned)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f, _phase(progress, total, "export") as p:
            if fmt == "safetensors":
                f.write(header)
                for t in planned:
                    x = _converted(source, t)  # keeps the memory alive while its view is written
                    f.write(tensor_memoryview(x))
                    del x
                    p.advance(t.out_nbytes)
            else:
                w = _PtWriter(f, "archive")
                w.record("data.pkl", _pt_data_pkl(planned))
                w.record("byteorder", sys.byteorder.encode("ascii"))
                for i, t in enumerate(planned):
                    x = _converted(source, t)
                    with w.tensor_record(f"data/{i}", x.numel() * x.element_size()) as rec:
                        rec.write(tensor_memoryview(x))
                    del x
                    p.advance(t.out_nbytes)
                w.record("version", b"3\n")
                w.close()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return ExportResult(out, fmt, step, len(planned), total, tuple(skipped))


def _converted(source: _TensorSource, t: _Planned) -> torch.Tensor:
    x = source.tensor(t.key, t.meta)
    if x.dtype != t.out_dtype:
        x = x.to(t.out_dtype)
    return x.contiguous()


# ----------------------------------------------------------------------------------------- cp


@dataclass(frozen=True)
class CopyResult:
    """One step handled by :func:`copy_steps`: ``"copied"`` or ``"skipped"`` (already there)."""

    step: int
    status: str
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"step": self.step, "status": self.status, "bytes": self.nbytes}


def _same_root(a: Storage, b: Storage) -> bool:
    ra, rb = getattr(a, "root", None), getattr(b, "root", None)
    return type(a) is type(b) and ra is not None and ra == rb and (
        getattr(a, "fs", None) is getattr(b, "fs", None))


def _copy_file(src: Storage, src_path: str, dst: Storage, dst_path: str, size: int,
               expected: str, step: int, name: str, p: Progress) -> None:
    writer = dst.open_writer(dst_path)
    try:
        hasher = Hasher()
        pos = 0
        while pos < size:
            n = min(_CHUNK, size - pos)
            data = src.read_bytes(src_path, pos, n)
            hasher.update(data)
            writer.write(data)
            pos += n
            p.advance(n)
        if hasher.value() != expected:
            raise CorruptCheckpointError(
                f"step {step}: {name}: checksum of the source is {hasher.value()}, the manifest "
                f"says {expected}; nothing was committed at the destination", step=step, path=name)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def _copy_one(src: Storage, dst: Storage, step: int, manifest: Manifest, raw: bytes,
              p: Progress) -> None:
    sdir = step_dir_name(step)
    sizes = _file_sizes(src, sdir, [f.path for f in manifest.files])
    for f in manifest.files:
        if sizes[f.path] != f.size:
            what = "file is missing" if sizes[f.path] is None else (
                f"size is {sizes[f.path]} bytes, the manifest says {f.size}")
            raise CorruptCheckpointError(f"step {step}: {f.path}: {what} at the source",
                                         step=step, path=f.path)
    staged = dst.supports_rename
    write_dir = staging_dir_name(step, new_attempt_id()) if staged else sdir
    written: list[str] = []
    try:
        dst.makedirs(write_dir)
        for f in manifest.files:
            target = join(write_dir, f.path)
            if "/" in f.path:
                dst.makedirs(target.rsplit("/", 1)[0])
            written.append(target)
            _copy_file(src, join(sdir, f.path), dst, target, f.size, f.checksum, step, f.path, p)
        got = _file_sizes(dst, write_dir, [f.path for f in manifest.files])
        for f in manifest.files:
            if got[f.path] != f.size:
                raise StorageError(f"copy of step {step}: {f.path} has {got[f.path]} bytes at "
                                   f"{dst.url}, expected {f.size}")
        # The commit, last: the manifest (bytes as at the source) makes the step visible.
        if staged:
            dst.write_bytes(join(write_dir, MANIFEST_NAME), raw)
            dst.fsync_dir(write_dir)
            dst.rename(write_dir, sdir)
            dst.fsync_dir("")
        else:
            dst.write_bytes(join(sdir, MANIFEST_NAME), raw, exclusive=True)
    except BaseException:
        with contextlib.suppress(CkptmgrError):
            if staged:
                dst.remove(write_dir, recursive=True)
            else:
                for path in written:
                    dst.remove(path)
        raise


def copy_steps(src_url: str, dst_url: str, steps: Sequence[int] | None = None, *,
               src_options: Mapping[str, Any] | None = None,
               dst_options: Mapping[str, Any] | None = None,
               progress: Progress | None = None,
               log: Callable[[str], None] | None = None) -> list[CopyResult]:
    """Copy committed steps from one root to another (e.g. local disk to ``gs://``).

    Per step: the source manifest is read, every file is streamed to the destination while its
    whole-file checksum is computed and compared with the manifest, the destination sizes are
    checked, and only then is the manifest written (the staging directory renamed into place on
    POSIX, the manifest object written last with a conditional create on object stores). A step
    already committed at the destination with the same save attempt is skipped.

    Args:
        steps: the steps to copy (None: every committed step).
        log: called with one line per step.

    Raises:
        CheckpointNotFoundError: a requested step is not committed at the source.
        CheckpointExistsError: a step is committed at the destination from another save, or an
            uncommitted leftover of it blocks the copy.
        CorruptCheckpointError: a source file does not match its manifest (nothing of that step is
            committed at the destination).
        ConfigError: source and destination are the same root.
    """
    src = open_storage(src_url, src_options)
    dst = open_storage(dst_url, dst_options)
    if _same_root(src, dst):
        raise ConfigError(f"source and destination are the same root ({src.url})")
    available = _committed(src)
    if steps is None:
        chosen = available
    else:
        chosen = sorted({_check_step(s) for s in steps})
        for s in chosen:
            if s not in available:
                raise _not_found(src, s, available)
    at_dst = set(_committed(dst))
    plans: list[tuple[int, Manifest, bytes, bool]] = []
    for s in chosen:
        manifest, raw = _read_manifest(src, s)
        skip = False
        if s in at_dst:
            try:
                existing, _ = _read_manifest(dst, s)
            except CorruptCheckpointError:
                existing = None
            if existing is None or existing.attempt != manifest.attempt or (
                    existing.files != manifest.files):
                raise CheckpointExistsError(
                    f"step {s} is already committed at {dst.url} from another save; delete it "
                    "there first (ckptmgr prune) or copy other steps")
            skip = True
        elif dst.supports_rename and dst.exists(step_dir_name(s)):
            raise CheckpointExistsError(
                f"step {s} has an uncommitted leftover at {dst.url}; remove it first "
                "(ckptmgr prune --incomplete) if no job is saving there")
        plans.append((s, manifest, raw, skip))
    say = log or (lambda _line: None)
    total = sum(m.total_bytes for _, m, _, skip in plans if not skip)
    results: list[CopyResult] = []
    with _phase(progress, total, "copy") as p:
        for s, manifest, raw, skip in plans:
            if skip:
                say(f"step {s}: already at the destination, skipped")
                results.append(CopyResult(s, "skipped", 0))
                continue
            say(f"copying step {s} ({format_bytes(manifest.total_bytes)})")
            _copy_one(src, dst, s, manifest, raw, p)
            results.append(CopyResult(s, "copied", manifest.total_bytes))
    return results


# ------------------------------------------------------------------------------------- import


class _CachedReader(FileSystemReader):
    """DCP's FileSystemReader that unpickles ``.metadata`` once for the many loads of an import."""

    _cached: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._cached is None:
            self._cached = super().read_metadata(*args, **kwargs)
        return self._cached


class _LazyImportPlanner(CkptSavePlanner):
    """Our save planner over placeholder (meta) tensors; each tensor is read from the DCP source
    only when the writer asks for it, a batch of up to ``_IMPORT_BATCH`` bytes at a time."""

    def __init__(self, reader: FileSystemReader, sources: Mapping[str, str],
                 metas: Mapping[str, TensorStorageMetadata], p: Progress) -> None:
        super().__init__()
        self._reader = reader
        self._sources = dict(sources)  # our flat key -> the DCP key, in state order
        self._order = list(sources)
        self._pos = {k: i for i, k in enumerate(self._order)}
        self._metas = metas
        self._cache: dict[str, torch.Tensor] = {}
        self._progress = p

    def _load_batch(self, first: str) -> None:
        self._cache.clear()  # drop the previous batch before allocating the next
        batch: dict[str, torch.Tensor] = {}
        size = 0
        for key in self._order[self._pos[first]:]:
            meta = self._metas[self._sources[key]]
            nbytes = _numel(meta.size) * _element_size(meta.properties.dtype)
            if batch and size + nbytes > _IMPORT_BATCH:
                break
            batch[self._sources[key]] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            size += nbytes
        dcp_load(batch, self._reader, DefaultLoadPlanner(), None)
        ours = {v: k for k, v in self._sources.items()}
        self._cache = {ours[k]: t for k, t in batch.items()}

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = super().lookup_object(index)
        if isinstance(obj, torch.Tensor) and obj.is_meta:
            if index.fqn not in self._cache:
                self._load_batch(index.fqn)
            obj = self._cache.pop(index.fqn)
            self._progress.advance(obj.numel() * obj.element_size())
        return obj


def _set_path(root: dict[str, Any], path: Sequence[Any], value: Any) -> None:
    cur: Any = root
    for key, nxt in itertools.pairwise(path):
        default: Any = [] if isinstance(nxt, int) else {}
        if isinstance(cur, list):
            cur.extend([None] * (key + 1 - len(cur)))
            if cur[key] is None:
                cur[key] = default
            cur = cur[key]
        else:
            cur = cur.setdefault(key, default)
    last = path[-1]
    if isinstance(cur, list):
        cur.extend([None] * (last + 1 - len(cur)))
    cur[last] = value


def _nest(items: Mapping[str, Any], mappings: Any) -> dict[str, Any]:
    """DCP's flat items back in their nested containers (by the save's ``planner_data``); the flat
    items themselves when the map is missing or does not fit."""
    if not isinstance(mappings, Mapping):
        return dict(items)
    paths = {k: mappings.get(k) for k in items}
    if not all(isinstance(p, tuple) and p and isinstance(p[0], str) and all(
            isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool) and x >= 0)
            for x in p) for p in paths.values()):
        return dict(items)
    root: dict[str, Any] = {}
    try:
        for k, value in items.items():
            _set_path(root, paths[k], value)  # type: ignore[arg-type]
    except (TypeError, IndexError, KeyError, AttributeError):
        return dict(items)
    return root


def _local_dir(src: str) -> str:
    if src.startswith("file://"):
        src = src[len("file://"):]
    elif "://" in src:
        raise ConfigError(f"import reads a local DCP directory, got {redact_url(src)!r}; copy "
                          "the checkpoint to local disk first")
    path = os.path.abspath(os.path.expanduser(src))
    if not os.path.isdir(path):
        raise ConfigError(f"{src!r} is not a directory")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointNotFoundError(
            f"{src!r} holds no DCP .metadata file: not a committed plain-DCP checkpoint")
    return path


def import_dcp(src: str | os.PathLike[str], dst_url: str, step: int, *, trusted: bool = False,
               metrics: Mapping[str, float] | None = None,
               metadata: Mapping[str, Any] | None = None,
               storage_options: Mapping[str, Any] | None = None,
               progress: Progress | None = None) -> StepInfo:
    """Bring in a checkpoint written by plain DCP as committed ``step`` of the root ``dst_url``.

    ``src`` is a local directory written by ``torch.distributed.checkpoint.save`` (torch_xla's
    manager, torchtitan, ...): a ``.metadata`` file and ``*.distcp`` data files. It is read with
    DCP's public ``FileSystemReader`` and written through ckptmgr's own writer, so the result is a
    normal step: JSON metadata, checksums, the commit protocol, world size 1 (sharded tensors are
    assembled; the manager reshards on restore). Tensors are read a batch of at most 256 MiB (or
    one tensor) at a time. Python values stay JSON where they can; the rest is stored with pickle
    and needs ``trusted=True`` again at restore.

    Args:
        src: the DCP checkpoint directory (a local path or ``file://`` URL).
        dst_url: the ckptmgr root.
        step: the step number to commit it as.
        trusted: must be True: DCP's ``.metadata`` and values are pickle, which runs code from the
            file. Pass it only for checkpoints you trust.
        metrics, metadata: recorded in the manifest (``metadata`` gains ``imported_from``).
        storage_options: fsspec options of ``dst_url``.
        progress: receives the tensor bytes imported.

    Returns:
        The new step's :class:`~ckptmgr.info.StepInfo`.

    Raises:
        UnsafeCheckpointError: ``trusted`` is not True (checked before any I/O).
        CheckpointNotFoundError: ``src`` has no ``.metadata``.
        CheckpointExistsError: ``step`` already exists at the destination (committed, or an
            uncommitted leftover).
        SaveError: reading the source or writing the step failed; nothing was committed.
    """
    if trusted is not True:
        raise UnsafeCheckpointError(
            "importing a plain DCP checkpoint unpickles its .metadata and values, which can run "
            "code; pass trusted=True (--trusted) only for checkpoints you trust")
    step = _check_step(step)
    src_s = os.fspath(src)
    path = _local_dir(src_s)
    metrics_d = {str(k): float(v) for k, v in (metrics or {}).items()}
    meta_d = dict(metadata or {})
    meta_d.setdefault("imported_from", redact_url(src_s))
    storage = open_storage(dst_url, storage_options)
    if step in _committed(storage):
        raise CheckpointExistsError(f"step {step} is already committed in {storage.url}")
    if storage.exists(step_dir_name(step)):
        raise CheckpointExistsError(
            f"step {step} has an uncommitted leftover in {storage.url}; remove it first "
            "(ckptmgr prune --incomplete) if no job is saving there")
    reader = _CachedReader(path)
    try:
        md = reader.read_metadata()
        flat: dict[str, Any] = {}
        metas: dict[str, TensorStorageMetadata] = {}
        values: dict[str, Any] = {}
        for key, sm in md.state_dict_metadata.items():
            if isinstance(sm, TensorStorageMetadata):
                metas[key] = sm
            else:
                values[key] = None
        if values:
            dcp_load(values, reader, DefaultLoadPlanner(), None)
    except CheckpointException as e:
        raise SaveError(f"could not read the DCP checkpoint {src_s!r}: {_first_error(e)}",
                        step=step) from e
    except (OSError, EOFError, pickle.UnpicklingError, ValueError, RuntimeError) as e:
        raise SaveError(f"could not read the DCP checkpoint {src_s!r}: {type(e).__name__}: {e}",
                        step=step) from e
    # Re-nest by DCP's flattening map, then flatten by ours: DCP flattens lists of plain values
    # (optimizer param_groups) that ckptmgr stores as one value, and restore looks keys up our way.
    placeholders = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype, device="meta")
                    for k, m in metas.items()}
    items = {k: placeholders[k] if k in metas else values[k] for k in md.state_dict_metadata}
    flat = flatten_state(_nest(items, md.planner_data)).flat
    dcp_key = {id(t): k for k, t in placeholders.items()}
    sources = {key: dcp_key[id(v)] for key, v in flat.items() if isinstance(v, torch.Tensor)}
    attempt = new_attempt_id()
    staged = storage.supports_rename
    sdir = step_dir_name(step)
    plan = CommitPlan(step=step, attempt=attempt,
                      write_dir=staging_dir_name(step, attempt) if staged else sdir,
                      step_dir=sdir, staged=staged, overwrite=False, world_size=1,
                      metrics=metrics_d, metadata=meta_d)
    storage.makedirs(plan.write_dir)
    writer = CkptStorageWriter(storage, plan, 0, trusted=True)
    total = sum(_numel(m.size) * _element_size(m.properties.dtype) for m in metas.values())
    try:
        with _phase(progress, total, "import") as p:
            planner = _LazyImportPlanner(reader, sources, metas, p)
            dcp_save(flat, writer, planner, None)
    except CheckpointException as e:
        _discard(storage, plan)
        raise SaveError(f"import of {src_s!r} as step {step} failed: {_first_error(e)}",
                        step=step) from e
    except BaseException:
        _discard(storage, plan)
        raise
    assert writer.manifest is not None, "the writer committed no manifest"
    return StepInfo.from_manifest(writer.manifest)


def _first_error(e: CheckpointException) -> str:
    for _rank, f in sorted(e.failures.items()):
        exc = f[0] if isinstance(f, tuple) else f
        return f"{type(exc).__name__}: {exc}"
    return str(e)


def _discard(storage: Storage, plan: CommitPlan) -> None:
    """Remove what a failed import wrote (never a committed step's files)."""
    with contextlib.suppress(CkptmgrError):
        if plan.staged:
            storage.remove(plan.write_dir, recursive=True)
        elif not storage.exists(join(plan.step_dir, MANIFEST_NAME)):
            storage.remove(plan.step_dir, recursive=True)
