"""Checkpoints written by plain DCP (torch_xla's manager, torchtitan, ``dcp.save``): restored in
place, and imported as committed steps of a root. Both only with ``trusted=True``: DCP's
``.metadata`` and the Python values in it are pickle, and unpickling runs code from the file.

Such a checkpoint is a directory with DCP's ``.metadata`` and ``*.distcp`` files, no manifest of
ours; it is read with DCP's own readers (``FileSystemReader`` for local directories, DCP's
``FsspecReader`` for fsspec URLs), never through our reader, and never written.

**Restore in place** (a plain-DCP step listed in a root, :mod:`ckptmgr.step_store` only checks
that its ``.metadata`` exists): :func:`prepare_foreign_restore` on every rank (the caller agrees
on the outcome; it refuses with :class:`~ckptmgr.errors.UnsafeCheckpointError` before any I/O
unless ``trusted=True``, and checks every data file name stays inside the step), then
:func:`load_foreign` (collective over the group it is given). Keys: DCP flattens nested
containers further than ckptmgr does (an optimizer's ``param_groups`` become
``param_groups.0.lr``, ...); a Python value the target holds as one key is rebuilt from the
checkpoint's entries below it with the save's own ``planner_data`` paths (:func:`nest_items`).

**Import** (:func:`import_dcp`, ``ckptmgr import``): the source is read with DCP's public
``FileSystemReader`` and saved again through our writer and commit, in one process (no process
group), without holding the whole state in memory:

1) :class:`CachedMetadataReader` unpickles the source's ``.metadata`` once for the many loads;
2) :func:`nest_items` puts DCP's flat items back in their containers, so that our own flattening
   (which stores lists of plain values as one value) decides the keys restore looks up;
3) :class:`LazyImportPlanner` is our save planner over placeholder (meta) tensors: each tensor is
   loaded from the source only when the writer asks for it, a batch at a time.
"""

from __future__ import annotations

import io
import itertools
import logging
import math
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ckptmgr.codec.layout import check_step, step_dir_name
from ckptmgr.dcp.checkpoint import (
    empty_containers,
    first_failure,
    prime_unprimed_optimizers,
    raise_load_failure,
)
from ckptmgr.dcp.compat import dcp_load, dcp_save, fsspec_reader
from ckptmgr.dcp.planner import CkptLoadPlanner, CkptSavePlanner
from ckptmgr.dcp.shards import ShardedTensor
from ckptmgr.dcp.spmd import SpmdLoadPlanner, has_sharded
from ckptmgr.dcp.state import FlatState, flatten_state
from ckptmgr.dcp.writer import CkptStorageWriter
from ckptmgr.dcp.xla import wrap_xla_tensors
from ckptmgr.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    RestoreError,
    SaveError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from ckptmgr.info import StepInfo
from ckptmgr.lease import writer_lease
from ckptmgr.progress import Progress, phase
from ckptmgr.step_store import StepStore
from ckptmgr.storage import FsspecStorage, LocalStorage, Storage, open_storage, redact_url

__all__ = ["CachedMetadataReader", "LazyImportPlanner", "PreparedForeignRestore", "import_dcp",
           "load_foreign", "nest_items", "prepare_foreign_restore"]

log = logging.getLogger("ckptmgr")


# ---------------------------------------------------------------------------------------------
# Reading the source


class CachedMetadataReader(FileSystemReader):
    """DCP's FileSystemReader that unpickles ``.metadata`` once for the many loads of an import."""

    _cached: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._cached is None:
            self._cached = super().read_metadata(*args, **kwargs)
        return self._cached


def _reader(storage: Storage, step: int) -> StorageReader:
    """DCP's reader of ``step``'s directory under ``storage``."""
    name = step_dir_name(step)
    if isinstance(storage, LocalStorage):
        return FileSystemReader(os.path.join(storage.root, name))
    if isinstance(storage, FsspecStorage):
        fs = storage.fs
        return fsspec_reader(fs.unstrip_protocol(storage.full(name)),
                             dict(getattr(fs, "storage_options", None) or {}))
    raise RestoreError(f"step {step} in {storage.url} was written by plain DCP, which ckptmgr "
                       f"reads only from local or fsspec roots, not {type(storage).__name__}",
                       step=step)


def _read_metadata(reader: StorageReader, step: int, url: str) -> Metadata:
    """The step's unpickled ``.metadata`` with every data file name checked to stay inside it."""
    try:
        md = reader.read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError,
            ImportError, IndexError, TypeError) as e:
        raise CorruptCheckpointError(
            f"step {step} in {url}: its DCP .metadata cannot be read ({type(e).__name__}: {e})",
            step=step, path=".metadata") from e
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"step {step} in {url}: .metadata holds a "
                                     f"{type(md).__name__}, not DCP Metadata", step=step,
                                     path=".metadata")
    for info in (md.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", "") or "")
        if not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
            raise UnsafeCheckpointError(f"step {step} in {url}: .metadata names data file "
                                        f"{rel!r} outside the step directory", step=step)
    return md


def _nbytes(meta: TensorStorageMetadata) -> int:
    return math.prod(meta.size) * meta.properties.dtype.itemsize


# ---------------------------------------------------------------------------------------------
# DCP's flat items back in their containers


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


def nest_items(items: Mapping[str, Any], mappings: Any) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------------
# Restore in place


class _TrustedLoad:
    """Mixin: Python values come as DCP's pickle bytes; unpickled (the caller trusts the step)."""

    values: dict[str, Any]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=False)


class _ForeignLoadPlanner(_TrustedLoad, CkptLoadPlanner):
    """DCP's default load planning (resharding) on our flat state, values unpickled."""


class _ForeignSpmdLoadPlanner(_TrustedLoad, SpmdLoadPlanner):
    """The SPMD load planner (sharded XLA tensors), values unpickled."""


@dataclass
class PreparedForeignRestore:
    """A checked restore of a plain-DCP step: the target, what to read, and from where."""

    step: int
    url: str
    state: FlatState
    reader: StorageReader
    metadata: Metadata
    load: dict[str, Any]  # DCP key -> target tensor, placeholder tensor, or None (a value)
    rebuilt: dict[str, list[str]]  # our value key -> the DCP keys it is rebuilt from
    extracted: dict[str, tuple[str, list[str]]]  # our value key -> (a DCP value above it, path)
    spmd: bool
    allow_partial: bool


def prepare_foreign_restore(storage: Storage, step: int, state_dict: Mapping[str, Any], *,
                            planner: str, allow_partial: bool,
                            trusted: bool) -> PreparedForeignRestore:
    """Read (unpickle) ``step``'s DCP metadata and match the target against it (every rank).

    Raises:
        UnsafeCheckpointError: ``trusted`` is not True (before any I/O), or the metadata names a
            file outside the step directory.
        CorruptCheckpointError: the metadata cannot be read.
        StateMismatchError: missing keys (unless ``allow_partial``), shape or dtype mismatches,
            or entries the target holds an empty container for (an unprimed optimizer's state).
    """
    url = f"{storage.url}/{step_dir_name(step)}"
    if trusted is not True:
        raise UnsafeCheckpointError(
            f"step {step} ({url}) was written by plain DCP (torch_xla's CheckpointManager, "
            "torchtitan, dcp.save): its .metadata and Python values are pickle, and unpickling "
            "runs code from the file. Pass trusted=True to restore(), only if you trust who "
            "wrote it, or convert it once with `ckptmgr import --trusted`", step=step)
    reader = _reader(storage, step)
    md = _read_metadata(reader, step, url)
    prime_unprimed_optimizers(state_dict, md)
    fs = flatten_state(state_dict, saved=md.state_dict_metadata.keys())
    if planner != "dcp":
        fs.flat = wrap_xla_tensors(fs.flat)
    saved = md.state_dict_metadata
    load: dict[str, Any] = {}
    rebuilt: dict[str, list[str]] = {}
    extracted: dict[str, tuple[str, list[str]]] = {}
    missing: list[str] = []
    mismatches: list[str] = []
    for key, value in fs.flat.items():
        entry = saved.get(key)
        if isinstance(value, (torch.Tensor, ShardedTensor)):
            shape = tuple(value.global_shape if isinstance(value, ShardedTensor)
                          else value.shape)
            if entry is None:
                missing.append(key)
            elif not isinstance(entry, TensorStorageMetadata):
                mismatches.append(f"{key}: a Python value in the checkpoint, a tensor here")
            elif tuple(entry.size) != shape or entry.properties.dtype != value.dtype:
                mismatches.append(f"{key}: checkpoint {list(entry.size)} "
                                  f"{entry.properties.dtype}, state {list(shape)} {value.dtype}")
            else:
                load[key] = value
            continue
        below = sorted(k for k in saved if k.startswith(f"{key}."))
        if entry is not None and not isinstance(entry, TensorStorageMetadata):
            load[key] = None
        elif entry is None and below:
            rebuilt[key] = below
            for k in below:
                sub = saved[k]
                load[k] = (torch.empty(tuple(sub.size), dtype=sub.properties.dtype)
                           if isinstance(sub, TensorStorageMetadata) else None)
        elif entry is None and (ancestor := _value_ancestor(key, saved)) is not None:
            extracted[key] = ancestor
            load[ancestor[0]] = None
        elif entry is None:
            missing.append(key)
        else:
            mismatches.append(f"{key}: a tensor in the checkpoint, a Python value here")
    empty: list[str] = []
    empty_containers(state_dict, "", empty)
    unfilled = sorted(k for k in saved if k.startswith(tuple(f"{p}." for p in empty))
                      and k not in fs.flat)
    if mismatches or (missing and not allow_partial) or (unfilled and not allow_partial):
        lines = [f"step {step} ({url}, written by plain DCP) does not match the state:"]
        if missing:
            lines.append(f"{len(missing)} keys not in the checkpoint: {missing[:10]}"
                         + ("" if allow_partial else " (allow_partial=True loads the rest)"))
        lines += mismatches[:10]
        if unfilled and not allow_partial:
            lines.append(f"{len(unfilled)} checkpoint entries under containers your state holds "
                         f"empty, e.g. {unfilled[:6]}: an optimizer's state is empty until its "
                         "first step; call ckptmgr.prime_optimizer(optimizer) first")
        raise StateMismatchError("; ".join(lines), step=step, missing=missing + unfilled,
                                 mismatches=mismatches)
    spmd = has_sharded(load) or planner == "xla_spmd"
    return PreparedForeignRestore(step, url, fs, reader, md, load, rebuilt, extracted, spmd,
                                  allow_partial)


def _subtree(nested: Any, path: tuple[Any, ...] | list[str]) -> Any:
    for part in path:
        if isinstance(nested, Mapping) and part not in nested and str(part).isdigit():
            part = int(part)  # an int-keyed dict, its key joined into the flat name
        elif isinstance(nested, (list, tuple)):
            part = int(part)
        nested = nested[part]
    return nested


def _value_ancestor(key: str, saved: Mapping[str, Any]) -> tuple[str, list[str]] | None:
    """The Python value saved as one entry above ``key`` (planners that flatten less than ours,
    e.g. torch_xla's SPMDSavePlanner keeps ``extra`` whole), and the path down to ``key``."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        entry = saved.get(".".join(parts[:i]))
        if entry is not None:
            return None if isinstance(entry, TensorStorageMetadata) else (
                ".".join(parts[:i]), parts[i:])
    return None


def load_foreign(prepared: PreparedForeignRestore, *, rank: int, world_size: int,
                 group: Any) -> None:
    """(collective over ``group``) Load ``prepared``'s entries in place with DCP's reader.

    Raises:
        The CkptmgrError a rank met (prefixed with its rank), or RestoreError.
    """
    step, flat = prepared.step, dict(prepared.load)
    planner = (_ForeignSpmdLoadPlanner(flatten_state_dict=False) if prepared.spmd
               else _ForeignLoadPlanner())
    try:
        dcp_load(flat, prepared.reader, planner, group)
        if isinstance(planner, SpmdLoadPlanner):
            planner.write_back()
    except CheckpointException as e:
        raise_load_failure(e, rank=rank, world_size=world_size, step=step,
                           what=f"restore of plain-DCP step {step} ({prepared.url})")
    except Exception as e:  # e.g. torch_xla refusing a shard: not a raw backend error
        raise RestoreError(f"restore of plain-DCP step {step} ({prepared.url}) failed: "
                           f"{type(e).__name__}: {e}", step=step) from e
    values = {k: v for k, v in planner.values.items() if k in prepared.state.flat}
    paths = prepared.metadata.planner_data
    for key, below in prepared.rebuilt.items():
        items = {k: planner.values.get(k, flat.get(k)) for k in below}
        nested = nest_items(items, paths)
        first = paths.get(below[0]) if isinstance(paths, Mapping) else None
        depth = len(key.split("."))
        try:
            if not isinstance(first, tuple) or len(first) <= depth:
                raise KeyError(key)
            values[key] = _subtree(nested, first[:depth])
        except (KeyError, IndexError, TypeError) as e:
            raise RestoreError(f"step {step} ({prepared.url}): cannot rebuild {key!r} from the "
                               f"checkpoint entries {below[:5]}", step=step) from e
    for key, (above, path) in prepared.extracted.items():
        try:
            values[key] = _subtree(planner.values[above], path)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            if prepared.allow_partial:
                continue
            raise StateMismatchError(
                f"step {step} ({prepared.url}, written by plain DCP): {key!r} is not in the "
                f"checkpoint's value {above!r}", step=step, missing=[key]) from e
    prepared.state.apply_values(values)
    log.info("restored plain-DCP step %d from %s", step, prepared.url)


# ---------------------------------------------------------------------------------------------
# Import as a committed step


class LazyImportPlanner(CkptSavePlanner):
    """Our save planner over placeholder (meta) tensors; each tensor is read from the DCP source
    only when the writer asks for it, a batch of up to ``batch_bytes`` bytes (at least one
    tensor) at a time.

    Args:
        reader: the DCP source.
        sources: our flat key -> the source's key, for every tensor, in the order of the state.
        metas: the source's tensor metadata, by the source's key.
        batch_bytes: the most tensor bytes loaded per DCP read (one larger tensor is still read).
        on_bytes: called with the bytes of each tensor handed to the writer.
    """

    def __init__(self, reader: FileSystemReader, sources: Mapping[str, str],
                 metas: Mapping[str, TensorStorageMetadata], *, batch_bytes: int,
                 on_bytes: Callable[[int], None]) -> None:
        super().__init__()
        self._reader = reader
        self._sources = dict(sources)  # our flat key -> the DCP key, in state order
        self._order = list(sources)
        self._pos = {k: i for i, k in enumerate(self._order)}
        self._metas = metas
        self._cache: dict[str, torch.Tensor] = {}
        self._batch_bytes = batch_bytes
        self._on_bytes = on_bytes

    def _load_batch(self, first: str) -> None:
        self._cache.clear()  # drop the previous batch before allocating the next
        batch: dict[str, torch.Tensor] = {}
        size = 0
        for key in self._order[self._pos[first]:]:
            meta = self._metas[self._sources[key]]
            nbytes = _nbytes(meta)
            if batch and size + nbytes > self._batch_bytes:
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
            self._on_bytes(obj.numel() * obj.element_size())
        return obj


_IMPORT_BATCH = 256 * 1024 * 1024  # tensors loaded per DCP read during import (at least one)


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
    step = check_step(step)
    src_s = os.fspath(src)
    path = _local_dir(src_s)
    metrics_d = {str(k): float(v) for k, v in (metrics or {}).items()}
    meta_d = dict(metadata or {})
    meta_d.setdefault("imported_from", redact_url(src_s))
    storage = open_storage(dst_url, storage_options)
    if step in StepStore(storage).committed_steps():
        raise CheckpointExistsError(f"step {step} is already committed in {storage.url}")
    if storage.exists(step_dir_name(step)):
        raise CheckpointExistsError(
            f"step {step} has an uncommitted leftover in {storage.url}; remove it first "
            "(ckptmgr prune --incomplete) if no job is saving there")
    reader = CachedMetadataReader(path)
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
    flat = flatten_state(nest_items(items, md.planner_data)).flat
    dcp_key = {id(t): k for k, t in placeholders.items()}
    sources = {key: dcp_key[id(v)] for key, v in flat.items() if isinstance(v, torch.Tensor)}
    store = StepStore(storage)
    total = sum(_nbytes(m) for m in metas.values())
    with writer_lease(storage) as lease:
        store.fence = lease.check
        plan = store.begin_save(step, forced=True, overwrite=False, world_size=1,
                                metrics=metrics_d, metadata=meta_d)
        assert plan is not None, "a forced save is planned or refused, never skipped"
        writer = CkptStorageWriter.for_attempt(storage, plan, 0, trusted=True, fence=lease.check)
        try:
            with phase(progress, total, "import") as p:
                planner = LazyImportPlanner(reader, sources, metas, batch_bytes=_IMPORT_BATCH,
                                            on_bytes=p.advance)
                dcp_save(flat, writer, planner, None)
        except CheckpointException as e:
            store.discard(plan)
            raise SaveError(f"import of {src_s!r} as step {step} failed: {_first_error(e)}",
                            step=step) from e
        except BaseException:
            store.discard(plan)
            raise
    assert writer.manifest is not None, "the writer committed no manifest"
    return StepInfo.from_manifest(writer.manifest)


def _first_error(e: CheckpointException) -> str:
    _, exc, failures = first_failure(e)
    return f"{type(exc).__name__}: {exc}" if failures else str(e)
