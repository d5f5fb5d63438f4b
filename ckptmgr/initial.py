"""Starting a run from weights saved elsewhere: a Hugging Face directory, a ``.safetensors`` file,
a ``torch.save`` file or another ckptmgr root (``CheckpointManager.load_initial``).

What a source is, by what ``source`` names:
- a local directory with ``model.safetensors.index.json`` (the Hugging Face layout), or
  ``model.safetensors``, or ``pytorch_model.bin[.index.json]``, or some ``*.safetensors`` files;
- a local ``.safetensors`` file (read by our own parser: no pickle, tensor by tensor);
- a local ``.pt``/``.pth``/``.bin`` file, read with ``torch.load(weights_only=True, mmap=True)``
  (nested dicts are flattened with ``.``);
- anything else is a ckptmgr root (local or any fsspec URL): its newest committed step is read
  through our DCP reader, resharding exactly as ``restore`` does. A step written by plain DCP
  (pickle metadata) is refused: ``ckptmgr import --trusted`` it first.

Names: a source tensor named ``n`` goes into the flat key ``key_map(n)`` of the state (a callable
returning None drops it; a dict maps the names it holds and keeps the others). Without
``key_map``, ``n`` goes into the flat key ``n``; when no name matches that way and one top-level
key ``p`` of the state makes ``p.n`` match (the usual ``{"model": model}`` wrapper), ``p.n`` is
used. Only tensors are loaded. Keys of the state that the source lacks stay as they are (logged);
a shape mismatch or a source that matches nothing is :class:`StateMismatchError`. File sources are
cast to the target's dtype; a ckptmgr root must match dtypes as ``restore`` requires.

Ranks: every rank calls :func:`load_initial` (the caller agrees on the outcome). File sources are
read whole on each rank, one tensor at a time, and each rank copies the slices its DTensors hold;
a ckptmgr root is loaded collectively.

Files are untrusted bytes, read by :mod:`ckptmgr.formats` (:mod:`~ckptmgr.formats.hf` picks the
reader): only regular files are opened (symbolic links followed, as the Hugging Face hub cache
needs; a FIFO or device is refused, never waited on); an index may name only plain file names in
its directory; every number of a safetensors header is checked against the file before anything
is allocated; a zip ``torch.save`` file's storages are checked against their records before it is
memory-mapped. A malformed file is :class:`ConfigError` naming it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ckptmgr._dist import Comm
from ckptmgr._redact import redact
from ckptmgr.dcp.checkpoint import (
    PreparedRestore,
    RestoreSource,
    load_step,
    prepare_restore,
    read_restore_source,
)
from ckptmgr.dcp.state import FlatState, flatten_state
from ckptmgr.errors import (
    ConfigError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from ckptmgr.formats.hf import is_file_source, read_file_source
from ckptmgr.step_store import StepStore
from ckptmgr.storage import open_storage

__all__ = ["KeyMap", "load_initial"]

log = logging.getLogger("ckptmgr")

KeyMap = Callable[[str], "str | None"] | Mapping[str, str]


def _match(names: list[str], targets: Mapping[str, Any], key_map: KeyMap | None,
           ) -> dict[str, str]:
    """source name -> flat key of the state."""
    if key_map is not None:
        out: dict[str, str] = {}
        for n in names:
            t = key_map.get(n, n) if isinstance(key_map, Mapping) else key_map(n)
            if t is not None:
                out[n] = t
        return out
    direct = {n: n for n in names if n in targets}
    if direct:
        return direct
    best: dict[str, str] = {}
    for p in sorted({k.split(".", 1)[0] for k in targets}):
        found = {n: f"{p}.{n}" for n in names if f"{p}.{n}" in targets}
        if len(found) > len(best):
            best = found
    return best


def _copy_into(target: Any, src: torch.Tensor, key: str) -> None:
    """Copy the part of the global tensor ``src`` that ``target`` holds (all of it, or a
    DTensor's local shard), casting to the target's dtype."""
    to_local = getattr(target, "to_local", None)
    if to_local is None:
        with torch.no_grad():
            target.copy_(src)
        return
    local = to_local()
    chunks = list(target.__create_chunk_list__())
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise ConfigError(f"{key!r}: a DTensor with {len(chunks)} local regions; load_initial "
                          "copies one region per rank (shard or replicate on each mesh axis)")
    part = src
    for dim, (o, s) in enumerate(zip(chunks[0].offsets, chunks[0].sizes, strict=True)):
        part = part.narrow(dim, int(o), int(s))
    with torch.no_grad():
        local.copy_(part)


def _load_files(path: str, state_dict: Mapping[str, Any], key_map: KeyMap | None) -> int:
    tensors = {t.name: t for t in read_file_source(path)}
    fs = flatten_state(state_dict)
    targets = {k: fs.flat[k] for k in fs.tensor_keys()}
    pairs = _match(list(tensors), targets, key_map)
    unknown = sorted(t for t in pairs.values() if t not in targets)
    pairs = {n: t for n, t in pairs.items() if t in targets}
    _check_pairs(path, pairs, targets, unknown)
    bad = [f"{t}: source {list(tensors[n].shape)}, state {list(targets[t].shape)}"
           for n, t in pairs.items() if tuple(tensors[n].shape) != tuple(targets[t].shape)]
    if bad:
        raise StateMismatchError(f"{len(bad)} shapes differ between {path} and the state: "
                                 f"{bad[:10]}", step=None, missing=[], mismatches=bad)
    nbytes = 0
    for n, t in pairs.items():
        src = tensors[n].read()  # one source tensor in memory at a time
        _copy_into(targets[t], src, t)
        nbytes += src.numel() * src.element_size()
        del src
    fs.apply_values({})  # load_state_dict on every Stateful, with its now-filled state dict
    return nbytes


def _check_pairs(source: str, pairs: Mapping[str, str], targets: Mapping[str, Any],
                 unknown: list[str]) -> None:
    if not pairs:
        hint = (f"the key map gives keys the state lacks, e.g. {unknown[:5]}" if unknown
                else "pass key_map to rename")
        raise StateMismatchError(
            f"nothing in {source} matches the state's tensors (e.g. {sorted(targets)[:5]}); "
            f"{hint}", step=None, missing=sorted(targets), mismatches=[])
    if unknown:
        log.warning("load_initial: %d names mapped to keys the state lacks, left out: %s",
                    len(unknown), unknown[:10])
    left = sorted(set(targets) - set(pairs.values()))
    if left:
        log.warning("load_initial: %d tensors of the state are not in %s and stay as they are: "
                    "%s", len(left), source, left[:10])


def _read_root(url: str, storage_options: Mapping[str, Any] | None, verify: bool,
               ) -> tuple[int, RestoreSource]:
    """(coordinator) The newest committed step of root ``url``, its manifest and metadata."""
    store = StepStore(open_storage(url, storage_options, writable=False))
    scan = store.scan()
    if not scan.committed:
        if scan.dcp_steps:
            raise UnsafeCheckpointError(
                f"{store.url} holds only steps written by plain DCP (pickle metadata): run "
                "`ckptmgr import --trusted` into a root first")
        raise ConfigError(f"source {store.url} is neither a weights file, a Hugging Face "
                          "directory nor a ckptmgr root with a committed step")
    step = scan.committed[-1]
    return step, read_restore_source(store, step, verify=verify)


def _prepare_root(url: str, step: int, src: RestoreSource, state_dict: Mapping[str, Any],
                  key_map: KeyMap | None, world_size: int,
                  ) -> tuple[PreparedRestore, FlatState]:
    """(every rank) Match the step's names with the state and check shapes and dtypes."""
    fs = flatten_state(state_dict)
    targets = {k: fs.flat[k] for k in fs.tensor_keys()}
    pairs = _match(list(src.metadata.state_dict_metadata), targets, key_map)
    unknown = sorted(t for t in pairs.values() if t not in targets)
    pairs = {n: t for n, t in pairs.items() if t in targets}
    _check_pairs(f"{redact(url)} step {step}", pairs, targets, unknown)
    renamed = {n: targets[t] for n, t in pairs.items()}  # source names -> the state's tensors
    prepared = prepare_restore(src, step, renamed, planner="auto", allow_partial=True,
                               trusted=False, world_size=world_size)
    return prepared, fs


def load_initial(source: str | os.PathLike[str], state_dict: Mapping[str, Any], *,
                 key_map: KeyMap | None, comm: Comm,
                 storage_options: Mapping[str, Any] | None = None, verify: bool = True) -> int:
    """(every rank of ``comm``) Load ``source``'s tensors into ``state_dict`` in place; the
    bytes read on this rank. See the module docstring for sources and names.

    Raises:
        StateMismatchError: nothing matches, or shapes differ (ckptmgr roots: dtypes too).
        ConfigError: an unreadable, malformed or unknown source, or not a regular file.
        UnsafeCheckpointError: a plain-DCP source (pickle), or an index naming anything but a
            plain file name in its directory.
        CorruptCheckpointError, StorageError: as ``restore``, for a ckptmgr root; StorageError
            also when reading a local file fails midway.
    """
    if key_map is not None and not (callable(key_map) or isinstance(key_map, Mapping)):
        raise ConfigError(f"key_map must be a callable or a dict, got {type(key_map).__name__}")
    path = os.fspath(source)
    if is_file_source(path):
        return comm.agree(lambda: _load_files(path, state_dict, key_map))
    # A root is loaded collectively, once every rank has checked it against its state.
    step, src = comm.on_coordinator(lambda: _read_root(path, storage_options, verify))
    prepared, fs = comm.agree(lambda: _prepare_root(path, step, src, state_dict, key_map,
                                                    comm.world_size), token=step)
    store = StepStore(open_storage(path, storage_options, writable=False))
    nbytes = load_step(prepared, store, step, rank=comm.rank, world_size=comm.world_size,
                       group=comm.group, verify=verify, trusted=False)
    fs.apply_values({})  # load_state_dict on every Stateful, with its now-filled state dict
    log.info("load_initial: loaded step %d of %s", step, store.url)
    return nbytes

