"""What every command of :mod:`ckptmgr.tools` shares: progress reporting, step resolution, and
reading a step's manifest and metadata the way the manager does (JSON only, every path checked to
stay inside its step directory).

The step-directory helpers here (:func:`_committed`, :func:`_read_manifest`,
:func:`_read_metadata`, :func:`_only_our_files`, :func:`_discard`) are the tools' own copies of the
step life cycle; they are kept in this one module so that they can be replaced in one place.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckptmgr.dcp import CommitPlan, ItemLocation, checksum, decode_metadata
from ckptmgr.errors import (
    CheckpointNotFoundError,
    CkptmgrError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptmgr.layout import MANIFEST_NAME, join, parse_step_name, step_dir_name
from ckptmgr.manifest import Manifest, ManifestError, decode_manifest
from ckptmgr.storage import Storage, is_not_found

_CHUNK = 16 * 1024 * 1024  # read buffer of verify and copy


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


def _only_our_files(storage: Storage, dirname: str) -> bool:
    """Whether every file in ``dirname`` has a name ckptmgr writes (as the manager checks)."""
    names = storage.list_files(dirname)
    return all(n.startswith(("data-", "metadata-", f"{MANIFEST_NAME}.tmp-")) for n in names)


def _discard(storage: Storage, plan: CommitPlan) -> None:
    """Remove what a failed import wrote (never a committed step's files)."""
    with contextlib.suppress(CkptmgrError):
        if plan.staged:
            storage.remove(plan.write_dir, recursive=True)
        elif not storage.exists(join(plan.step_dir, MANIFEST_NAME)):
            storage.remove(plan.step_dir, recursive=True)
