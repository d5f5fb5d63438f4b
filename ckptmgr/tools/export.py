"""Exporting one committed step into consolidated, weights-only files, tensor by tensor: one
safetensors or ``torch.save`` file (:func:`export_step`), or the Hugging Face layout of sharded
safetensors files plus their index (:func:`export_hf`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ckptmgr.dcp import ItemLocation, checksum, tensor_memoryview
from ckptmgr.dcp.checkpoint import read_step_metadata
from ckptmgr.errors import ConfigError, CorruptCheckpointError
from ckptmgr.layout import join, step_dir_name
from ckptmgr.manifest import Manifest
from ckptmgr.step_store import StepStore
from ckptmgr.storage import Storage, open_storage
from ckptmgr.tools._common import (
    Progress,
    _element_size,
    _file_sizes,
    _locations,
    _natural,
    _numel,
    _phase,
)
from ckptmgr.tools._formats import PtWriter, pt_data_pkl, safetensors_header

__all__ = ["HF_INDEX_NAME", "ExportResult", "HfExportResult", "export_hf", "export_step",
           "parse_size"]

HF_INDEX_NAME = "model.safetensors.index.json"  # the name transformers looks for

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
        if lower.endswith((".pt", ".pth")):
            return "pt"
        raise ConfigError(
            f"output {out!r} has a suffix export does not know: accepted are .safetensors "
            "(safetensors) and .pt or .pth (torch.save's format); rename the output, or give the "
            "format explicitly (format='pt' / --format pt, e.g. for a .bin file)")
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
    step, source, planned, skipped = _open_step(url, step, storage_options, only, cast)
    header = safetensors_header(planned, step) if fmt == "safetensors" else b""
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
                w = PtWriter(f, "archive")
                w.record("data.pkl", pt_data_pkl(planned))
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


def _open_step(url: str, step: int | None, storage_options: Mapping[str, Any] | None,
               only: str | None, cast: torch.dtype | None,
               ) -> tuple[int, _TensorSource, list[_Planned], list[str]]:
    """Resolve ``step`` under ``url``, read its metadata, select the tensors and check that
    every file they are read from is there with its manifest size (before writing anything)."""
    storage = open_storage(url, storage_options, writable=False)
    store = StepStore(storage)
    step = store.resolve(step)
    manifest, _ = store.read_manifest_bytes(step)
    if manifest.byteorder != sys.byteorder:
        raise ConfigError(f"step {step} was written on a {manifest.byteorder}-endian host; "
                          f"this host is {sys.byteorder}-endian")
    md = read_step_metadata(store, step, manifest)
    planned, skipped = _select(md, only, cast)
    source = _TensorSource(storage, step, manifest, md)
    source.check_files((t.key, t.meta) for t in planned)
    return step, source, planned, skipped


_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10,
          "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3, "m": 10**6, "g": 10**9,
          "t": 10**12}


def parse_size(size: int | str, *, field: str = "max_shard_size") -> int:
    """Bytes from an int or a string as transformers reads them (``"5GB"`` = 5 * 10**9,
    ``"500MiB"`` = 500 * 2**20, ``"1000"`` = 1000 bytes).

    Raises:
        ConfigError: not a positive size.
    """
    n: float | None = None
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif isinstance(size, str):
        m = _SIZE.match(size)
        unit = m.group(2).lower() if m else None
        if m and unit in _UNITS:
            n = float(m.group(1)) * _UNITS[unit]
    if n is None or int(n) < 1:
        raise ConfigError(f"{field} must be a positive number of bytes or a size such as "
                          f"'5GB' or '500MiB', got {size!r}")
    return int(n)


@dataclass(frozen=True)
class HfExportResult:
    """What :func:`export_hf` wrote.

    Attributes:
        out_dir: the output directory.
        index: the index file (``model.safetensors.index.json``) in it.
        shards: the shard files' names, in order.
        step: the exported step.
        num_tensors: tensors written.
        nbytes: bytes of tensor data written (the index's ``metadata.total_size``).
        skipped: keys left out: Python values, and keys the key map dropped.
    """

    out_dir: str
    index: str
    shards: tuple[str, ...]
    step: int
    num_tensors: int
    nbytes: int
    skipped: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"out_dir": self.out_dir, "index": self.index, "shards": list(self.shards),
                "format": "hf", "step": self.step, "num_tensors": self.num_tensors,
                "bytes": self.nbytes, "skipped": list(self.skipped)}


def _renamed(planned: list[_Planned], key_map: Callable[[str], str | None] | None,
             ) -> tuple[list[_Planned], list[str]]:
    """Apply ``key_map`` to the output names; None drops a tensor."""
    if key_map is None:
        return planned, []
    kept: list[_Planned] = []
    dropped: list[str] = []
    for t in planned:
        name = key_map(t.name)
        if name is None:
            dropped.append(t.key)
        elif not isinstance(name, str) or not name:
            raise ConfigError(f"key_map must return a non-empty str or None, returned {name!r} "
                              f"for {t.name!r}")
        else:
            kept.append(replace(t, name=name))
    if not kept:
        raise ConfigError("key_map dropped every tensor")
    return kept, dropped


def _shard(planned: list[_Planned], max_bytes: int) -> list[list[_Planned]]:
    """Tensors in order into shards of at most ``max_bytes`` (as transformers does: a tensor
    larger than the limit gets a shard of its own)."""
    shards: list[list[_Planned]] = []
    size = 0
    for t in planned:
        if not shards or (size + t.out_nbytes > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.out_nbytes
    return shards


def export_hf(url: str, step: int | None, out_dir: str | os.PathLike[str], *,
              max_shard_size: int | str = "5GB", prefix: str | None = None,
              key_map: Callable[[str], str | None] | None = None,
              dtype: str | torch.dtype | None = None,
              storage_options: Mapping[str, Any] | None = None,
              progress: Progress | None = None) -> HfExportResult:
    """Write committed ``step``'s tensors in the Hugging Face layout: sharded
    ``model-0000k-of-0000n.safetensors`` files plus ``model.safetensors.index.json``.

    The layout is the one ``transformers``' ``save_pretrained`` writes, so
    ``from_pretrained(out_dir)`` (with a ``config.json`` you add) and
    ``safetensors.torch.load_file`` read it; an index is written even for a single shard.
    Streaming: tensors are read one at a time (chunks of sharded tensors assembled and
    checksum-verified) and appended to the shard being written, which is fsynced and renamed into
    place when full; peak memory is about the largest tensor, never the model. The index comes
    last, so a directory with an index holds a complete export; a failed export removes the
    files it wrote.

    Args:
        url: the root (local or any fsspec URL).
        step: the committed step (None: the newest).
        out_dir: a local directory (created if missing).
        max_shard_size: the largest shard, in bytes or as ``"5GB"``/``"500MiB"`` (a tensor larger
            than this gets a shard of its own).
        prefix: keep only keys under this prefix and drop it (``"model."`` turns
            ``model.layers.0.weight`` into ``layers.0.weight``).
        key_map: called with each output name (after ``prefix``); returns the name to write, or
            None to leave the tensor out.
        dtype: cast floating-point tensors (``"bf16"``, ``"fp16"``, ``"fp32"`` or a torch dtype).
        storage_options: fsspec options of the root.
        progress: receives the bytes written.

    Raises:
        CheckpointNotFoundError: ``step`` is not committed.
        CorruptCheckpointError: a size or checksum mismatch (the files written are removed).
        ConfigError: a bad option, no tensor selected, two tensors mapped to one name, or a dtype
            safetensors cannot store.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    limit = parse_size(max_shard_size)
    cast = _cast_dtype(dtype)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"the output {out_dir!r} is a file; export --format hf writes a "
                          "directory")
    step, source, planned, skipped = _open_step(url, step, storage_options, prefix, cast)
    planned, dropped = _renamed(planned, key_map)
    seen: dict[str, str] = {}
    for t in planned:
        if t.name in seen:
            raise ConfigError(f"{seen[t.name]!r} and {t.key!r} are both written as {t.name!r}; "
                              "change the prefix or the key map")
        seen[t.name] = t.key
    shards = _shard(planned, limit)
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    headers = [safetensors_header(s, step) for s in shards]  # refuses dtypes before any write
    total = sum(t.out_nbytes for t in planned)
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    tmp = ""
    try:
        with _phase(progress, total, "export") as p:
            for name, header, shard in zip(names, headers, shards, strict=True):
                tmp = os.path.join(out_dir, f".{name}.tmp-{os.getpid()}")
                with open(tmp, "wb") as f:
                    f.write(header)
                    for t in shard:
                        x = _converted(source, t)  # one tensor in memory at a time
                        f.write(tensor_memoryview(x))
                        del x
                        p.advance(t.out_nbytes)
                    f.flush()
                    os.fsync(f.fileno())
                final = os.path.join(out_dir, name)
                os.replace(tmp, final)
                written.append(final)
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: name for name, shard in zip(names, shards, strict=True)
                                for t in shard}}
        tmp = os.path.join(out_dir, f".{HF_INDEX_NAME}.tmp-{os.getpid()}")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(out_dir, HF_INDEX_NAME))
    except BaseException:
        for path in [tmp, *written]:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    return HfExportResult(out_dir, os.path.join(out_dir, HF_INDEX_NAME), tuple(names), step,
                          len(planned), total, tuple(skipped + dropped))


def _converted(source: _TensorSource, t: _Planned) -> torch.Tensor:
    x = source.tensor(t.key, t.meta)
    if x.dtype != t.out_dtype:
        x = x.to(t.out_dtype)
    return x.contiguous()
