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
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptmgr._dist import Comm
from ckptmgr._redact import redact
from ckptmgr.dcp import tensor_memoryview
from ckptmgr.dcp.checkpoint import (
    PreparedRestore,
    RestoreSource,
    load_step,
    prepare_restore,
    read_restore_source,
)
from ckptmgr.dcp.state import FlatState, flatten_state
from ckptmgr.errors import ConfigError, StateMismatchError, UnsafeCheckpointError
from ckptmgr.step_store import StepStore
from ckptmgr.storage import open_storage

__all__ = ["KeyMap", "load_initial"]

log = logging.getLogger("ckptmgr")

KeyMap = Callable[[str], "str | None"] | Mapping[str, str]

_ST_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "U16": torch.uint16, "U32": torch.uint32,
    "U64": torch.uint64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "C64": torch.complex64, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024
_PT_SUFFIXES = (".pt", ".pth", ".bin")


@dataclass
class _SourceTensor:
    """One tensor of a file source, read only when asked."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]


def _safetensors(path: str) -> list[_SourceTensor]:
    """The tensors of one safetensors file, each read from its offsets when asked."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ConfigError(f"{path} is not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ConfigError(f"{path} is not a safetensors file: {e}") from e
    base = 8 + n
    out: list[_SourceTensor] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ConfigError(f"{path}: {name!r} has dtype {entry.get('dtype')!r}, which "
                              "ckptmgr cannot read")
        shape = tuple(int(s) for s in entry["shape"])
        start, end = (int(x) for x in entry["data_offsets"])

        def read(start: int = start, end: int = end, shape: tuple[int, ...] = shape,
                 dtype: torch.dtype = dtype, name: str = name) -> torch.Tensor:
            buf = torch.empty(shape, dtype=dtype)
            view = tensor_memoryview(buf)
            if len(view) != end - start:
                raise ConfigError(f"{path}: {name!r} has {end - start} bytes, its shape needs "
                                  f"{len(view)}")
            with open(path, "rb") as f:
                f.seek(base + start)
                if f.readinto(view) != len(view):
                    raise ConfigError(f"{path} is truncated in the bytes of {name!r}")
            return buf

        out.append(_SourceTensor(name, shape, dtype, read))
    return out


def _flatten_loaded(value: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out[prefix] = value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _flatten_loaded(v, f"{prefix}.{k}" if prefix else str(k), out)


def _torch_file(path: str) -> list[_SourceTensor]:
    """The tensors of a ``torch.save`` file (weights only; memory-mapped where possible)."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    flat: dict[str, torch.Tensor] = {}
    _flatten_loaded(loaded, "", flat)
    return [_SourceTensor(k, tuple(v.shape), v.dtype, _constant(v)) for k, v in flat.items()]


def _constant(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


def _directory(path: str) -> list[_SourceTensor]:
    """The tensors of a Hugging Face model directory."""
    for index_name, reader in (("model.safetensors.index.json", _safetensors),
                               ("pytorch_model.bin.index.json", _torch_file)):
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map", {})
            files = sorted(set(weight_map.values()))
            for name in files:
                if os.path.basename(name) != name:
                    raise UnsafeCheckpointError(f"{index} names {name!r} outside {path}")
            return [t for name in files for t in reader(os.path.join(path, name))]
    for single, reader in (("model.safetensors", _safetensors),
                           ("pytorch_model.bin", _torch_file)):
        if os.path.isfile(os.path.join(path, single)):
            return reader(os.path.join(path, single))
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    return [t for name in files for t in _safetensors(os.path.join(path, name))]


def _is_file_source(path: str) -> bool:
    return os.path.isfile(path) or (os.path.isdir(path) and any(
        f.endswith((".safetensors", ".index.json")) or f == "pytorch_model.bin"
        for f in os.listdir(path)))


def _file_source(path: str) -> list[_SourceTensor]:
    if os.path.isdir(path):
        tensors = _directory(path)
    elif path.endswith(".safetensors"):
        tensors = _safetensors(path)
    elif path.endswith(_PT_SUFFIXES):
        tensors = _torch_file(path)
    else:
        raise ConfigError(f"source {path!r} must be a .safetensors, .pt, .pth or .bin file, a "
                          "Hugging Face directory or a ckptmgr root")
    if not tensors:
        raise ConfigError(f"source {path!r} holds no tensors")
    return tensors


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
    tensors = {t.name: t for t in _file_source(path)}
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
        ConfigError: an unreadable or unknown source.
        UnsafeCheckpointError: a plain-DCP source (pickle), or an index naming outside files.
        CorruptCheckpointError, StorageError: as ``restore``, for a ckptmgr root.
    """
    if key_map is not None and not (callable(key_map) or isinstance(key_map, Mapping)):
        raise ConfigError(f"key_map must be a callable or a dict, got {type(key_map).__name__}")
    path = os.fspath(source)
    if _is_file_source(path):
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

