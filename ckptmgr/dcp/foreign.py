"""Restoring a step written by plain DCP (torch_xla's manager, torchtitan, ``dcp.save``) in place.

Such a step is a ``<root>/<step>/`` directory with DCP's ``.metadata`` (pickle) and ``*.distcp``
files, no manifest of ours. It is read with DCP's own readers (``FileSystemReader`` for local
roots, DCP's ``FsspecReader`` for fsspec URLs), never through our reader and never written.

Unpickling ``.metadata`` and the Python values in it can run code: :func:`prepare_foreign_restore`
refuses with :class:`~ckptmgr.errors.UnsafeCheckpointError` before any I/O unless the caller
passed ``trusted=True``. Listing such steps (:mod:`ckptmgr.step_store`) only checks that the
``.metadata`` file exists.

Keys: DCP flattens nested containers further than ckptmgr does (an optimizer's
``param_groups`` become ``param_groups.0.lr``, ...). A Python value the target holds as one key
is rebuilt from the checkpoint's entries below it with the save's own ``planner_data`` paths.

Call order and ranks: :func:`prepare_foreign_restore` on every rank (the caller agrees on the
outcome), then :func:`load_foreign` (collective over the group it is given).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ckptmgr.codec.layout import step_dir_name
from ckptmgr.dcp.checkpoint import raise_load_failure
from ckptmgr.dcp.compat import dcp_load, fsspec_reader
from ckptmgr.dcp.importer import nest_items
from ckptmgr.dcp.optim import prime_optimizer
from ckptmgr.dcp.planner import CkptLoadPlanner
from ckptmgr.dcp.shards import ShardedTensor
from ckptmgr.dcp.spmd import SpmdLoadPlanner, has_sharded
from ckptmgr.dcp.state import FlatState, flatten_state
from ckptmgr.dcp.xla import wrap_xla_tensors
from ckptmgr.errors import (
    CorruptCheckpointError,
    RestoreError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from ckptmgr.storage import FsspecStorage, LocalStorage, Storage

__all__ = ["PreparedForeignRestore", "load_foreign", "prepare_foreign_restore"]

log = logging.getLogger("ckptmgr")


class _TrustedLoad:
    """Mixin: Python values come as DCP's pickle bytes; unpickled (the caller trusts the step)."""

    values: dict[str, Any]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.values[read_item.dest_index.fqn] = torch.load(value, weights_only=False)


class _ForeignLoadPlanner(_TrustedLoad, CkptLoadPlanner):
    """DCP's default load planning (resharding) on our flat state, values unpickled."""


class _ForeignSpmdLoadPlanner(_TrustedLoad, SpmdLoadPlanner):
    """The SPMD load planner (sharded XLA tensors), values unpickled."""


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


def _prime(state_dict: Mapping[str, Any], md: Metadata) -> None:
    """Prime top-level optimizer objects without state whose checkpoint entry has state."""
    for key, value in state_dict.items():
        if isinstance(value, torch.optim.Optimizer) and not value.state and any(
                k.startswith(f"{key}.state.") for k in md.state_dict_metadata):
            prime_optimizer(value)


def _empty_prefixes(value: Any, prefix: str, out: list[str], depth: int = 0) -> None:
    if not isinstance(value, Mapping) or depth > 64:
        return
    if not value and prefix:
        out.append(f"{prefix}.")
    for k, v in value.items():
        _empty_prefixes(v, f"{prefix}.{k}" if prefix else str(k), out, depth + 1)


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
    _prime(state_dict, md)
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
    _empty_prefixes(state_dict, "", empty)
    unfilled = sorted(k for k in saved if k.startswith(tuple(empty)) and k not in fs.flat)
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
