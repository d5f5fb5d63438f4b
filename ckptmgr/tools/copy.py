"""Copying committed steps from one root to another, checksums checked on the way, the manifest
written last."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptmgr.codec.checksum import Hasher
from ckptmgr.codec.layout import (
    SHARED_DIR,
    check_step,
    is_shared_chunk_path,
    join,
    shared_chunk_digest,
    shared_temp_path,
    step_dir_name,
)
from ckptmgr.codec.manifest import FileEntry, Manifest
from ckptmgr.errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptmgr.lease import writer_lease
from ckptmgr.progress import Progress, phase
from ckptmgr.step_store import StepStore
from ckptmgr.storage import AtomicRename, Storage, open_storage
from ckptmgr.tools._common import (
    _CHUNK,
    DigestCheck,
    _file_sizes,
    format_bytes,
)

__all__ = ["CopyResult", "copy_steps"]


@dataclass(frozen=True)
class CopyResult:
    """One step handled by :func:`copy_steps`: ``"copied"`` or ``"skipped"`` (already there).

    Attributes:
        step: the step.
        status: ``"copied"`` or ``"skipped"``.
        nbytes: bytes copied for it: its own files and the shared chunks the destination lacked.
        shared_copied: shared chunks it references that were copied (``reuse_unchanged=True``).
        shared_present: shared chunks it references that the destination held already (the
            same name is the same bytes: chunks are named by the hash of their content).
    """

    step: int
    status: str
    nbytes: int
    shared_copied: int = 0
    shared_present: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"step": self.step, "status": self.status, "bytes": self.nbytes,
                "shared_copied": self.shared_copied, "shared_present": self.shared_present}


def _same_root(a: Storage, b: Storage) -> bool:
    ra, rb = getattr(a, "root", None), getattr(b, "root", None)
    return type(a) is type(b) and ra is not None and ra == rb and (
        getattr(a, "fs", None) is getattr(b, "fs", None))


def _copy_file(src: Storage, src_path: str, dst: Storage, dst_path: str, size: int,
               expected: str, step: int, name: str, p: Progress) -> None:
    """Stream one file, its checksum (and for a shared chunk, the digest its name promises)
    checked before the destination file is committed."""
    digest = DigestCheck(name) if is_shared_chunk_path(name) else None
    writer = dst.open_writer(dst_path)
    try:
        hasher = Hasher()
        pos = 0
        while pos < size:
            n = min(_CHUNK, size - pos)
            data = src.read_bytes(src_path, pos, n)
            hasher.update(data)
            if digest is not None:
                digest.update(data)
            writer.write(data)
            pos += n
            p.advance(n)
        wrong = None
        if hasher.value() != expected:
            wrong = f"checksum of the source is {hasher.value()}, the manifest says {expected}"
        elif digest is not None:
            wrong = digest.mismatch()
        if wrong is not None:
            raise CorruptCheckpointError(
                f"step {step}: {name}: {wrong}; nothing was committed at the destination (run "
                f"`ckptmgr verify` on the source to see all of its damage)", step=step, path=name)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def _copy_chunk(src: Storage, dst: Storage, f: FileEntry, step: int, p: Progress) -> None:
    """Put shared chunk ``f`` into the destination's ``chunks/`` the way the writer does: under
    a temporary name, then renamed into place (POSIX); on object stores the object appears whole
    or not at all. A temporary file left by a failure is no chunk: the destination's next
    clean-up removes it (``ckptmgr prune``, or its writer's next commit)."""
    renames = dst if isinstance(dst, AtomicRename) else None
    target = shared_temp_path(shared_chunk_digest(f.path), secrets.token_hex(6)) if (
        renames is not None) else f.path
    _copy_file(src, f.path, dst, target, f.size, f.checksum, step, f.path, p)
    if renames is not None:
        try:
            renames.rename(target, f.path)
        except StorageError:
            # The same bytes landed first by another way (the same name is the same content).
            if not (dst.exists(f.path) and dst.size(f.path) == f.size):
                raise


def _copy_one(src: Storage, dst: Storage, step: int, manifest: Manifest, raw: bytes,
              p: Progress, fence: Callable[[], None], chunks: _Chunks) -> tuple[int, int, int]:
    """Copy one step: its shared chunks the destination lacks, its own files, then its
    manifest. Returns (shared chunks copied, shared chunks the destination held already, bytes
    of the chunks copied)."""
    sdir = step_dir_name(step)
    sizes = _file_sizes(src, sdir, [f.path for f in manifest.files])
    if manifest.shared:
        src_chunks = chunks.src_sizes()
        sizes.update({f.path: src_chunks.get(f.path) for f in manifest.shared})
    for f in (*manifest.files, *manifest.shared):
        if sizes[f.path] != f.size:
            what = ("shared chunk is missing" if is_shared_chunk_path(f.path) else
                    "file is missing") if sizes[f.path] is None else (
                f"size is {sizes[f.path]} bytes, the manifest says {f.size}")
            raise CorruptCheckpointError(
                f"step {step}: {f.path}: {what} at the source; nothing of the step was "
                f"committed at the destination (run `ckptmgr verify` on the source)",
                step=step, path=f.path)
    # Shared chunks first: the manifest that references them is the last thing written. One the
    # destination holds with the same name and size is the same bytes (named by their hash), so
    # it is referenced, as the writer references it (docs/byte-format.md, "Shared chunks").
    copied = present = nbytes = 0
    if manifest.shared:
        fence()  # a writer that lost the destination's lease writes no chunk either
        if dst.is_symlink(SHARED_DIR):
            raise UnsafeCheckpointError(
                f"{dst.url}/{SHARED_DIR} is a symbolic link; ckptmgr never writes through links: "
                f"replace it with a real directory, or copy step {step} to another root",
                step=step)
        dst.makedirs(SHARED_DIR)
        have = chunks.dst_sizes()
        for f in manifest.shared:
            if have.get(f.path) == f.size:
                present += 1
                continue
            _copy_chunk(src, dst, f, step, p)
            have[f.path] = f.size
            copied += 1
            nbytes += f.size
        if copied and isinstance(dst, AtomicRename):
            dst.fsync_dir(SHARED_DIR)  # the chunks' names are durable before the commit
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
    return copied, present, nbytes


class _Chunks:
    """The shared chunks of both roots, each listed once per copy (on first need)."""

    def __init__(self, src: Storage, dst: Storage) -> None:
        self.src, self.dst = src, dst
        self._src: dict[str, int] | None = None
        self._dst: dict[str, int] | None = None

    def src_sizes(self) -> dict[str, int]:
        if self._src is None:
            self._src = StepStore(self.src).shared_sizes()
        return self._src

    def dst_sizes(self) -> dict[str, int]:
        if self._dst is None:
            self._dst = StepStore(self.dst).shared_sizes()
        return self._dst


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

    A step saved with ``reuse_unchanged=True`` references shared chunks of its root
    (``chunks/<32 hex>``): each is copied into the destination's ``chunks/`` (checked against
    its checksum and against the hash its name is), unless the destination holds it already,
    before the manifest is written, so the copy stands alone: it restores from a root that
    holds nothing else. A copy that fails after some chunks were copied leaves them
    unreferenced; the destination's next clean-up (``ckptmgr prune``, or its writer's next
    commit) removes them.

    Args:
        steps: the steps to copy (None: every committed step).
        log: called with one line per step.

    Raises:
        CheckpointNotFoundError: a requested step is not committed at the source.
        CheckpointExistsError: a step is committed at the destination from another save, or an
            uncommitted leftover of it blocks the copy.
        CorruptCheckpointError: a source file or shared chunk is missing or does not match its
            manifest (nothing of that step is committed at the destination).
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
                    existing.files != manifest.files or existing.shared != manifest.shared):
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
    chunks = _Chunks(src, dst)
    total = sum(m.total_bytes for _, m, _, skip in plans if not skip)
    todo = {f.path: f.size for _, m, _, skip in plans if not skip for f in m.shared}
    if todo:  # the progress counts only the chunks the destination lacks
        have = chunks.dst_sizes()
        total += sum(size for path, size in todo.items() if have.get(path) != size)
    results: list[CopyResult] = []
    with phase(progress, total, "copy") as p, writer_lease(dst) as lease:
        for s, manifest, raw, skip in plans:
            if skip:
                say(f"step {s}: already at the destination, skipped")
                results.append(CopyResult(s, "skipped", 0))
                continue
            shared = (f" + {len(manifest.shared)} shared chunks, "
                      f"{format_bytes(manifest.shared_bytes)}") if manifest.shared else ""
            say(f"copying step {s} ({format_bytes(manifest.total_bytes)}{shared})")
            copied, present, nbytes = _copy_one(src, dst, s, manifest, raw, p, lease.check,
                                                chunks)
            results.append(CopyResult(s, "copied", manifest.total_bytes + nbytes, copied,
                                      present))
    return results
