"""Copying committed steps from one root to another, checksums checked on the way, the manifest
written last."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptmgr.codec.checksum import Hasher
from ckptmgr.codec.layout import (
    check_step,
    join,
    step_dir_name,
)
from ckptmgr.codec.manifest import Manifest
from ckptmgr.errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
    StorageError,
)
from ckptmgr.lease import writer_lease
from ckptmgr.progress import Progress, phase
from ckptmgr.step_store import StepStore
from ckptmgr.storage import AtomicRename, Storage, open_storage
from ckptmgr.tools._common import (
    _CHUNK,
    _file_sizes,
    format_bytes,
)

__all__ = ["CopyResult", "copy_steps"]


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
              p: Progress, fence: Callable[[], None]) -> None:
    sdir = step_dir_name(step)
    sizes = _file_sizes(src, sdir, [f.path for f in manifest.files])
    for f in manifest.files:
        if sizes[f.path] != f.size:
            what = "file is missing" if sizes[f.path] is None else (
                f"size is {sizes[f.path]} bytes, the manifest says {f.size}")
            raise CorruptCheckpointError(f"step {step}: {f.path}: {what} at the source",
                                         step=step, path=f.path)
    store = StepStore(dst, fence=fence)
    plan = store.begin_save(step, forced=True, overwrite=False, world_size=manifest.world_size,
                            attempt=manifest.attempt)
    assert plan is not None, "a forced save is planned or refused, never skipped"
    write_dir = plan.write_dir
    try:
        for f in manifest.files:
            target = join(write_dir, f.path)
            if "/" in f.path:
                dst.makedirs(target.rsplit("/", 1)[0])
            _copy_file(src, join(sdir, f.path), dst, target, f.size, f.checksum, step, f.path, p)
        got = _file_sizes(dst, write_dir, [f.path for f in manifest.files])
        for f in manifest.files:
            if got[f.path] != f.size:
                raise StorageError(f"copy of step {step}: {f.path} has {got[f.path]} bytes at "
                                   f"{dst.url}, expected {f.size}")
        # The commit, last: the manifest (bytes as at the source) makes the step visible.
        store.commit(plan, raw, fence)
    except BaseException:
        store.discard(plan)
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
    src = open_storage(src_url, src_options, writable=False)
    dst = open_storage(dst_url, dst_options)
    if _same_root(src, dst):
        raise ConfigError(f"source and destination are the same root ({src.url})")
    available = StepStore(src).committed_steps()
    if steps is None:
        chosen = available
    else:
        chosen = sorted({check_step(s) for s in steps})
        for s in chosen:
            if s not in available:
                raise StepStore(src).not_found(s, available)
    at_dst = set(StepStore(dst).committed_steps())
    plans: list[tuple[int, Manifest, bytes, bool]] = []
    for s in chosen:
        manifest, raw = StepStore(src).read_manifest_bytes(s)
        skip = False
        if s in at_dst:
            try:
                existing, _ = StepStore(dst).read_manifest_bytes(s)
            except CorruptCheckpointError:
                existing = None
            if existing is None or existing.attempt != manifest.attempt or (
                    existing.files != manifest.files):
                raise CheckpointExistsError(
                    f"step {s} is already committed at {dst.url} from another save; delete it "
                    "there first (ckptmgr prune) or copy other steps")
            skip = True
        elif isinstance(dst, AtomicRename) and dst.exists(step_dir_name(s)):
            raise CheckpointExistsError(
                f"step {s} has an uncommitted leftover at {dst.url}; remove it first "
                "(ckptmgr prune --incomplete) if no job is saving there")
        plans.append((s, manifest, raw, skip))
    say = log or (lambda _line: None)
    total = sum(m.total_bytes for _, m, _, skip in plans if not skip)
    results: list[CopyResult] = []
    with phase(progress, total, "copy") as p, writer_lease(dst) as lease:
        for s, manifest, raw, skip in plans:
            if skip:
                say(f"step {s}: already at the destination, skipped")
                results.append(CopyResult(s, "skipped", 0))
                continue
            say(f"copying step {s} ({format_bytes(manifest.total_bytes)})")
            _copy_one(src, dst, s, manifest, raw, p, lease.check)
            results.append(CopyResult(s, "copied", manifest.total_bytes))
    return results
