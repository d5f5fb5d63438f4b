"""Listing a root's steps: the one read-only command that needs no torch (``ckptmgr ls`` starts
without importing it), and the byte counts every command prints."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptmgr.codec.layout import MANIFEST_NAME, parse_staging_name, parse_step_name
from ckptmgr.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from ckptmgr.step_store import DCP_METADATA_NAME, StepStore
from ckptmgr.storage import open_storage

__all__ = ["SharedUsage", "StepListing", "format_bytes", "list_steps", "shared_usage"]


def format_bytes(n: float) -> str:
    """``12.0 MiB``: a byte count for people (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class StepListing:
    """One entry of a root: a committed step or the leftover of a save that never committed.

    Attributes:
        name: the directory (prefix) name under the root: ``"100"``, or ``".tmp-100-<attempt>"``
            for the staging directory of a save that crashed before its rename.
        step: the step number.
        committed: whether ``<name>/commit.json`` exists (a step is committed exactly then).
        status: ``"committed"``, ``"incomplete"`` (no manifest: a crashed or in-flight save) or
            ``"unreadable"`` (a manifest that does not parse, or names a path outside its
            step directory; restore would refuse it) or
            ``"dcp"`` (written by plain DCP: torch_xla, torchtitan; restorable with
            ``trusted=True``, never written or deleted by ckptmgr).
        time: commit time (UTC ISO 8601), None unless the manifest was read.
        total_bytes: bytes of the step's own files, in its directory (manifest's sum, else the
            listed files).
        world_size: ranks that saved it, when known.
        metrics: the metrics saved with it.
        error: why the manifest is unreadable, else None.
        shared_bytes: bytes of the shared chunks the step references (``reuse_unchanged=True``:
            stored once under the root's ``chunks/``, possibly shared with other steps); a
            restore reads ``total_bytes + shared_bytes``.
        shared_chunks: how many shared chunks it references.
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
    shared_bytes: int = 0
    shared_chunks: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the ``ls --json`` object)."""
        return {"step": self.step, "name": self.name, "committed": self.committed,
                "status": self.status, "time": self.time, "total_bytes": self.total_bytes,
                "world_size": self.world_size, "metrics": dict(self.metrics),
                "error": self.error, "shared_bytes": self.shared_bytes,
                "shared_chunks": self.shared_chunks}


def list_steps(url: str, *, storage_options: Mapping[str, Any] | None = None,
               must_exist: bool = False) -> list[StepListing]:
    """Every committed step of the root at ``url`` and every leftover of a save that never
    committed, ascending by step.

    Reads each committed step's manifest (for time, size and metrics); lists each leftover's files;
    a plain-DCP step is found by its ``.metadata`` file, never read (it is pickle). A root that
    does not exist is empty, unless ``must_exist``. Symlinked entries and names ckptmgr does not
    write are skipped. One bad step never hides the others: a manifest that is damaged or unsafe
    is listed as ``"unreadable"`` with the reason, and a step deleted while the root is listed
    (retention of a job writing it) is left out.

    Raises:
        ConfigError, BackendNotInstalledError: a bad URL (see :func:`ckptmgr.storage.open_storage`).
        CheckpointNotFoundError: ``must_exist`` and nothing exists at ``url``.
        StorageError: listing or reading failed.
    """
    storage = open_storage(url, storage_options, writable=False)
    if must_exist and not storage.exists(""):
        raise CheckpointNotFoundError(
            f"{storage.url} does not exist: no checkpoint root there; check the path (a root is "
            "the directory holding the step directories)", available=[])
    out: list[StepListing] = []
    for entry in storage.scan_root(MANIFEST_NAME):
        if entry.is_symlink or not entry.is_dir:
            continue
        step = parse_step_name(entry.name)
        staged = parse_staging_name(entry.name)
        if step is not None and entry.has_marker:
            try:
                m, _ = StepStore(storage).read_manifest_bytes(step)
            except CheckpointNotFoundError:
                continue  # deleted since the listing (retention): no longer a step
            except (CorruptCheckpointError, UnsafeCheckpointError) as e:
                size = sum(storage.list_files(entry.name).values())
                out.append(StepListing(entry.name, step, True, "unreadable", None, size, None,
                                       {}, str(e)))
                continue
            out.append(StepListing(entry.name, step, True, "committed", m.time, m.total_bytes,
                                   m.world_size, dict(m.metrics), shared_bytes=m.shared_bytes,
                                   shared_chunks=len(m.shared)))
        elif step is not None or staged is not None:
            s = step if step is not None else staged[0]  # type: ignore[index]
            files = storage.list_files(entry.name)
            dcp = step is not None and DCP_METADATA_NAME in files
            out.append(StepListing(entry.name, s, False, "dcp" if dcp else "incomplete", None,
                                   sum(files.values()), None))
    out.sort(key=lambda s: (s.step, not s.committed, s.name))
    return out


@dataclass(frozen=True)
class SharedUsage:
    """The shared chunks under a root's ``chunks/`` (``reuse_unchanged=True``), as listed now.

    Attributes:
        chunks: how many there are (temporary files of writes in flight left out).
        nbytes: their bytes: what the root holds once, whatever the number of steps sharing it.
    """

    chunks: int
    nbytes: int


def shared_usage(url: str, *, storage_options: Mapping[str, Any] | None = None) -> SharedUsage:
    """What the root's shared chunks take (one listing of ``chunks/``; nothing else is read).

    Raises:
        ConfigError, BackendNotInstalledError: a bad URL.
        StorageError: listing failed.
    """
    sizes = StepStore(open_storage(url, storage_options, writable=False)).shared_sizes()
    return SharedUsage(len(sizes), sum(sizes.values()))
