"""Deleting what the retention policy does not keep, and the leftovers of saves that never
committed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptmgr.codec.layout import (
    SHARED_DIR,
    is_shared_chunk_path,
    is_shared_temp_name,
    join,
    parse_staging_name,
    step_dir_name,
)
from ckptmgr.errors import CkptmgrError, StorageError
from ckptmgr.lease import writer_lease
from ckptmgr.policy import StepRecord, build_policy, steps_to_delete
from ckptmgr.step_store import StepStore
from ckptmgr.storage import open_storage
from ckptmgr.tools.listing import format_bytes, list_steps

__all__ = ["PruneResult", "prune_steps"]


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
        removed_chunks: shared chunks (``chunks/<32 hex>``, ``reuse_unchanged=True``) removed
            because no committed step references them any more, and temporary files of chunk
            writes that never finished.
        removed_chunk_bytes: their bytes.
    """

    deleted: tuple[int, ...]
    kept: tuple[int, ...]
    removed_leftovers: tuple[str, ...]
    dry_run: bool
    failed: tuple[str, ...] = ()
    foreign_leftovers: tuple[str, ...] = ()
    removed_chunks: tuple[str, ...] = ()
    removed_chunk_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"dry_run": self.dry_run, "deleted": list(self.deleted), "kept": list(self.kept),
                "removed_leftovers": list(self.removed_leftovers), "failed": list(self.failed),
                "foreign_leftovers": list(self.foreign_leftovers),
                "removed_chunks": list(self.removed_chunks),
                "removed_chunk_bytes": self.removed_chunk_bytes}


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

    Shared chunks (steps saved with ``reuse_unchanged=True``) go only when no committed step
    references them: after the deletions (and with ``incomplete``), the store's clean-up
    (:meth:`~ckptmgr.step_store.StepStore.remove_unreferenced_chunks`, through the same fenced
    door as every removal) removes the chunks that no remaining manifest lists, so every kept
    step still restores on its own. ``dry_run`` reports the chunks that would go.

    Args:
        log: called with one line per deletion (before it happens), e.g. ``print``.

    Raises:
        ConfigError: a bad option (the message names it).
        StorageError: listing failed. A failed deletion is reported in ``failed`` instead.
    """
    policy = build_policy(max_to_keep=keep_last or 0, keep_period=keep_every,
                          best_metric=best_metric, best_mode=best_mode, keep_best=keep_best)
    storage = open_storage(url, storage_options, writable=dry_run is False)
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
    store = StepStore(storage)
    with contextlib.nullcontext() if dry_run else writer_lease(storage) as lease:
        if lease is not None:
            store.fence = lease.check  # every removal below is fenced by it
        say = log or (lambda _line: None)
        verb = "would delete" if dry_run else "deleting"
        failed: list[str] = []
        deleted: list[int] = []
        for step in to_delete:
            say(f"{verb} step {step}")
            if dry_run:
                deleted.append(step)
                continue
            try:
                store.delete_step(step)  # manifest first; files ckptmgr did not write stay
            except CkptmgrError as err:
                failed.append(f"{step_dir_name(step)}: {err}")
                continue
            deleted.append(step)
        removed: list[str] = []
        foreign: list[str] = []
        if incomplete:
            for e in entries:
                if e.committed:
                    continue
                if parse_staging_name(e.name) is None and not store.is_ours(e.name):
                    say(f"leaving {e.name}: it holds files ckptmgr did not write")
                    foreign.append(e.name)
                    continue
                say(f"{'would remove' if dry_run else 'removing'} incomplete leftover {e.name}")
                try:
                    store.remove_leftover(e.name, dry_run=dry_run)
                except StorageError as err:
                    failed.append(f"{e.name}: {err}")
                    continue
                removed.append(e.name)
        chunks: list[str] = []
        chunk_bytes = 0
        if deleted or incomplete:
            sizes = _chunk_files(store)
            if sizes:
                try:
                    chunks = (_unreferenced_after(store, deleted, sizes) if dry_run
                              else store.remove_unreferenced_chunks())
                except CkptmgrError as err:
                    failed.append(f"{SHARED_DIR}/: {err}")
                chunk_bytes = sum(sizes.get(c, 0) for c in chunks)
                if chunks:
                    say(f"{'would remove' if dry_run else 'removed'} {len(chunks)} unreferenced "
                        f"shared chunks ({format_bytes(chunk_bytes)})")
    gone = set(deleted)
    kept = tuple(r.step for r in records if r.step not in gone)
    return PruneResult(tuple(deleted), kept, tuple(removed), dry_run, tuple(failed),
                       tuple(foreign), tuple(chunks), chunk_bytes)


def _chunk_files(store: StepStore) -> dict[str, int]:
    """Every file under the root's ``chunks/`` (chunks and temporary files), root-relative
    path -> bytes; {} when there is none (or it is a link, which is never followed)."""
    if store.storage.is_symlink(SHARED_DIR) or not store.storage.exists(SHARED_DIR):
        return {}
    return {join(SHARED_DIR, name): size
            for name, size in store.storage.list_files(SHARED_DIR).items()}


def _unreferenced_after(store: StepStore, deleted: list[int], files: dict[str, int]) -> list[str]:
    """(dry run: nothing is removed) The chunk files that the clean-up would remove once
    ``deleted`` are gone: those no other committed step's manifest lists, as
    :meth:`~ckptmgr.step_store.StepStore.remove_unreferenced_chunks` decides after a real run
    (nothing if a manifest cannot be read: then it removes nothing either)."""
    gone = set(deleted)
    referenced: set[str] = set()
    for step in store.committed_steps():
        if step in gone:
            continue
        try:
            referenced.update(f.path for f in store.read_manifest(step).shared)
        except CkptmgrError:
            return []
    return sorted(p for p in files
                  if p not in referenced and (is_shared_chunk_path(p) or is_shared_temp_name(
                      p.rpartition("/")[2])))


def _unix(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
