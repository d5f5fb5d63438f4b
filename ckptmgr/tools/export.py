"""Exporting one committed step into consolidated, weights-only files, tensor by tensor: one
safetensors or ``torch.save`` file (:func:`export_step`), or the Hugging Face layout of sharded
safetensors files plus their index (:func:`export_hf`)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ckptmgr.codec.checksum import checksum
from ckptmgr.codec.layout import is_shared_chunk_path, step_dir_name
from ckptmgr.codec.manifest import Manifest
from ckptmgr.codec.metadata import ItemLocation, MetadataDoc
from ckptmgr.dcp.metadata import metadata_from_doc
from ckptmgr.dcp.shards import coverage_problem
from ckptmgr.dcp.tensor_bytes import tensor_memoryview
from ckptmgr.errors import CkptmgrError, ConfigError, CorruptCheckpointError, StorageError
from ckptmgr.formats.hf import HF_INDEX_NAME, index_bytes, shard_file_names
from ckptmgr.formats.safetensors import safetensors_header
from ckptmgr.formats.torch_save import PtWriter, pt_data_pkl
from ckptmgr.progress import Progress, phase
from ckptmgr.step_store import StepStore
from ckptmgr.storage import Storage, open_storage
from ckptmgr.tools._common import (
    _element_size,
    _file_sizes,
    _locations,
    _natural,
    _numel,
    stored_path,
)

__all__ = ["HF_INDEX_NAME", "ExportResult", "HfExportResult", "export_hf", "export_step",
           "parse_size"]

HF_DEFAULT_PREFIX = "model"  # the entry export_hf takes when no prefix is given, if present

log = logging.getLogger("ckptmgr")

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

    def __init__(self, storage: Storage, step: int, manifest: Manifest, md: Metadata,
                 doc: MetadataDoc) -> None:
        self.storage = storage
        self.step = step
        self.sdir = step_dir_name(step)
        self.manifest = manifest
        self.locs = _locations(doc)
        # Own files and the shared chunks the step references (``chunks/<hex>``, root-relative).
        self.sizes = {f.path: f.size for f in (*manifest.files, *manifest.shared)}
        self.prefix: str | None = None  # the prefix the tensors were selected by (_open_step)
        self.tops = _tensor_tops(md)  # top-level entries holding tensors

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
        listed = self.sizes
        sizes = _file_sizes(self.storage, self.sdir, sorted(files))
        for f in sorted(files):
            if f not in listed:
                raise self._corrupt(f, "not listed in the manifest")
            if sizes[f] is None:
                raise self._corrupt(f, "shared chunk is missing (a step saved with "
                                       "reuse_unchanged; `ckptmgr verify` lists every damaged "
                                       "file)" if is_shared_chunk_path(f) else "file is missing")
            if sizes[f] != listed[f]:
                raise self._corrupt(f, f"size is {sizes[f]} bytes, the manifest says {listed[f]}")

    def _loc(self, key: str, offsets: tuple[int, ...]) -> ItemLocation:
        loc = self.locs.get((key, offsets))
        if loc is None:
            raise self._corrupt(self.manifest.metadata_file,
                                f"no stored bytes for {key!r} at offsets {list(offsets)}")
        return loc

    def _checked_loc(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                     dtype: torch.dtype) -> ItemLocation:
        """The stored bytes of one chunk, checked to be exactly what the chunk needs and to lie
        inside their file (its manifest size, which check_files compared with storage)."""
        loc = self._loc(key, offsets)
        need = _numel(sizes) * _element_size(dtype)
        if loc.length != need:
            raise self._corrupt(loc.file, f"{key!r} needs {need} bytes, the metadata says "
                                          f"{loc.length}")
        size = self.sizes.get(loc.file)
        if loc.offset < 0 or (size is not None and loc.offset > size - need):
            raise self._corrupt(loc.file, f"the bytes of {key!r} at {loc.offset} (+{need}) lie "
                                          f"outside the file's {size} bytes")
        return loc

    def _read_chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
                    dtype: torch.dtype) -> torch.Tensor:
        loc = self._checked_loc(key, offsets, sizes, dtype)
        buf = torch.empty(sizes, dtype=dtype)
        view = tensor_memoryview(buf)
        if len(view):
            self.storage.read_into(stored_path(self.sdir, loc.file), loc.offset, view)
        if checksum(view) != loc.checksum:
            raise self._corrupt(loc.file, f"checksum mismatch in the bytes of {key!r}")
        return buf

    def tensor(self, key: str, meta: TensorStorageMetadata) -> torch.Tensor:
        """The whole tensor ``key`` (chunks of a sharded tensor are assembled).

        Raises:
            CorruptCheckpointError: the chunks do not tile the tensor exactly once (a chunk
                outside it, two overlapping, or a gap: never exported as uninitialised memory),
                a chunk's bytes do not match its size or lie outside their file, or a checksum
                mismatch.
        """
        shape = tuple(int(s) for s in meta.size)
        dtype = meta.properties.dtype
        chunks = list(dict.fromkeys(
            (tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
            for c in meta.chunks if _numel(c.sizes) or not _numel(meta.size)))
        # coverage_problem skips empty chunks; a negative number in one would still reach torch.
        nums = [*shape, *(n for o, z in chunks for n in (*o, *z))]
        if any(n < 0 for n in nums) or any(len(o) != len(shape) or len(z) != len(shape)
                                           for o, z in chunks):
            problem: str | None = "a negative size or offset, or a chunk of another rank"
        else:
            problem = coverage_problem(shape, chunks)
        if problem is not None:
            raise self._corrupt(self.manifest.metadata_file, f"{key!r} of shape {list(shape)}: "
                                                             f"{problem}")
        for offsets, sizes in chunks:  # all bytes accounted for before the tensor is allocated
            self._checked_loc(key, offsets, sizes, dtype)
        if len(chunks) == 1 and chunks[0][1] == shape:
            return self._read_chunk(key, chunks[0][0], shape, dtype)
        full = torch.empty(shape, dtype=dtype)
        if not full.numel():  # nothing to place; the chunks' (empty) bytes are still verified
            for offsets, sizes in chunks:
                self._read_chunk(key, offsets, sizes, dtype)
            return full
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
        tops = _tensor_tops(md)
        what = f"under prefix {only!r}" if only is not None else "in this step"
        raise ConfigError(f"no tensors {what}; top-level keys with tensors: {tops}")
    return planned, skipped


# Top-level entries that are training state, not weights: beside them a ``model`` entry is the
# model (export_hf's default). Beside anything else (``lm_head`` next to ``model`` in a plain
# transformers state_dict) ``model`` is only part of the model: every tensor is exported.
_TRAINING_STATE = ("optim", "sched", "lr_sched", "rng", "scaler", "grad_scaler", "data",
                   "extra", "progress", "trainer", "train_state", "step", "epoch", "loops",
                   "callbacks")


def _default_entry(md: Metadata, default: str) -> bool:
    """Whether ``default`` is a subtree of the step's tensors beside training state only."""
    keys = [k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
    if not any(k.startswith(f"{default}.") for k in keys):
        return False  # absent, or one tensor named "model": not a model's entries
    return all(t == default or t.lower().startswith(_TRAINING_STATE) for t in _tensor_tops(md))


def _tensor_tops(md: Metadata) -> list[str]:
    """The top-level entries of a step that hold at least one tensor, sorted."""
    return sorted({k.split(".", 1)[0] for k, v in md.state_dict_metadata.items()
                   if isinstance(v, TensorStorageMetadata)})


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
        CorruptCheckpointError: a size or checksum mismatch, or chunks that do not cover a
            tensor exactly once (nothing is left at ``out``).
        ConfigError: a bad option, no tensor selected, or a dtype the format cannot store.
        StorageError: writing the output failed (nothing is left at ``out``).
    """
    out = os.fspath(out)
    fmt = _export_format(out, format)
    cast = _cast_dtype(dtype)
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise ConfigError(f"the output directory {parent!r} does not exist")
    step, source, planned, skipped = _open_step(url, step, storage_options, only, cast)
    _check_unique_names(planned, "choose another 'only' prefix")
    header = safetensors_header(planned, step) if fmt == "safetensors" else b""
    total = sum(t.out_nbytes for t in planned)
    tmp = ""
    try:
        tmp, f = _create_temp(parent, os.path.basename(out))
        with f, phase(progress, total, "export") as p:
            if fmt == "safetensors":
                f.write(header)
                for t in planned:
                    x = _converted(source, t)  # keeps the memory alive while its view is written
                    f.write(tensor_memoryview(x))
                    del x
                    p.advance(t.out_nbytes)
            else:
                w = PtWriter(f, "archive")
                try:
                    w.record("data.pkl", pt_data_pkl(planned))
                    w.record("byteorder", sys.byteorder.encode("ascii"))
                    for i, t in enumerate(planned):
                        x = _converted(source, t)
                        with w.tensor_record(f"data/{i}", x.numel() * x.element_size()) as rec:
                            rec.write(tensor_memoryview(x))
                        del x
                        p.advance(t.out_nbytes)
                    w.record("version", b"3\n")
                except BaseException:
                    # Closed after a failure too (a damaged chunk): a zip file left open writes
                    # into the closed temporary file when it is collected (an unraisable error).
                    with contextlib.suppress(Exception):
                        w.close()
                    raise
                w.close()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException as e:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError) and not isinstance(e, CkptmgrError):
            raise StorageError(f"writing the export to {out!r} failed (nothing was left there): "
                               f"{e.strerror or e}") from e
        raise
    return ExportResult(out, fmt, step, len(planned), total, tuple(skipped))


def _open_step(url: str, step: int | None, storage_options: Mapping[str, Any] | None,
               only: str | None, cast: torch.dtype | None, *, default_only: str | None = None,
               ) -> tuple[int, _TensorSource, list[_Planned], list[str]]:
    """Resolve ``step`` under ``url``, read its metadata, select the tensors and check that
    every file they are read from is there with its manifest size (before writing anything).

    ``default_only`` replaces ``only=None`` when the step has tensors under that top-level
    entry (export_hf's ``model``); otherwise every tensor is selected."""
    storage = open_storage(url, storage_options, writable=False)
    store = StepStore(storage)
    step = store.resolve(step)
    manifest, _ = store.read_manifest_bytes(step)
    if manifest.byteorder != sys.byteorder:
        raise ConfigError(f"step {step} was written on a {manifest.byteorder}-endian host; "
                          f"this host is {sys.byteorder}-endian")
    doc = store.read_metadata(step_dir_name(step), manifest)
    md = metadata_from_doc(doc, manifest)
    if only is None and default_only is not None and _default_entry(md, default_only):
        # transformers reads the model's own names: a training state's optimizer entries
        # would all be UNEXPECTED keys there (issue 31).
        only = default_only
    planned, skipped = _select(md, only, cast)
    source = _TensorSource(storage, step, manifest, md, doc)
    source.prefix = None if only is None else only.strip(".")
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
        prefix: the prefix whose keys were exported (named without it), or None when every
            tensor was: the ``prefix`` given, else ``"model"`` when the step has a top-level
            ``model`` entry.
        left_out: without a ``prefix`` given, the other top-level entries holding tensors that
            were not exported because the ``model`` entry was (e.g. ``("optim",)``).
    """

    out_dir: str
    index: str
    shards: tuple[str, ...]
    step: int
    num_tensors: int
    nbytes: int
    skipped: tuple[str, ...]
    prefix: str | None = None
    left_out: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"out_dir": self.out_dir, "index": self.index, "shards": list(self.shards),
                "format": "hf", "step": self.step, "num_tensors": self.num_tensors,
                "bytes": self.nbytes, "skipped": list(self.skipped), "prefix": self.prefix,
                "left_out": list(self.left_out)}


def _check_unique_names(planned: list[_Planned], hint: str) -> None:
    """Two tensors under one output name would overwrite each other's header entry."""
    seen: dict[str, str] = {}
    for t in planned:
        if t.name in seen:
            raise ConfigError(f"{seen[t.name]!r} and {t.key!r} are both written as {t.name!r}; "
                              f"{hint}")
        seen[t.name] = t.key


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
    checksum-verified) and appended to the shard being written under a temporary name; peak
    memory is about the largest tensor, never the model. Once every shard and the index are
    written and fsynced, they are renamed into place, the index last, so a directory with an
    index holds a complete export. A failed export leaves the output directory as it was: files
    of an earlier export at the same names are untouched (put back if a rename fails midway).

    Args:
        url: the root (local or any fsspec URL).
        step: the committed step (None: the newest).
        out_dir: a local directory (created if missing).
        max_shard_size: the largest shard, in bytes or as ``"5GB"``/``"500MiB"`` (a tensor larger
            than this gets a shard of its own).
        prefix: keep only keys under this prefix and drop it (``"model."`` turns
            ``model.layers.0.weight`` into ``layers.0.weight``). None: the step's top-level
            ``model`` entry when it has one (a training state's optimizer is not part of a
            Hugging Face model; the choice is logged and returned as ``prefix``), else every
            tensor.
        key_map: called with each output name (after ``prefix``); returns the name to write, or
            None to leave the tensor out.
        dtype: cast floating-point tensors (``"bf16"``, ``"fp16"``, ``"fp32"`` or a torch dtype).
        storage_options: fsspec options of the root.
        progress: receives the bytes written.

    Raises:
        CheckpointNotFoundError: ``step`` is not committed.
        CorruptCheckpointError: a size or checksum mismatch, or chunks that do not cover a
            tensor exactly once (the output directory is left as it was).
        ConfigError: a bad option, no tensor selected, two tensors mapped to one name, a dtype
            safetensors cannot store, or a directory at an output file's name.
        StorageError: writing into ``out_dir`` failed (it is left as it was).
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    limit = parse_size(max_shard_size)
    cast = _cast_dtype(dtype)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ConfigError(f"the output {out_dir!r} is a file; export --format hf writes a "
                          "directory")
    step, source, planned, skipped = _open_step(url, step, storage_options, prefix, cast,
                                                default_only=HF_DEFAULT_PREFIX)
    left_out: tuple[str, ...] = ()
    if prefix is None:
        if source.prefix is None:
            log.info("export_hf: step %d has no top-level %r entry beside training state only: "
                     "exporting every tensor", step, HF_DEFAULT_PREFIX)
        else:
            left_out = tuple(t for t in source.tops if t != source.prefix)
            log.info("export_hf: exporting step %d's %r entry, named without %r (left out: %s); "
                     "pass prefix= to choose another entry", step, source.prefix,
                     f"{source.prefix}.", ", ".join(left_out) or "nothing")
    planned, dropped = _renamed(planned, key_map)
    _check_unique_names(planned, "change the prefix or the key map")
    shards = _shard(planned, limit)
    n = len(shards)
    names = shard_file_names(n)
    headers = [safetensors_header(s, step) for s in shards]  # refuses dtypes before any write
    total = sum(t.out_nbytes for t in planned)
    for final in [*names, HF_INDEX_NAME]:
        path = os.path.join(out_dir, final)
        if os.path.isdir(path) and not os.path.islink(path):
            raise ConfigError(f"{path!r} is a directory; export --format hf writes a file of that "
                              "name: move the directory away")
    created = not os.path.lexists(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise StorageError(f"cannot create the output directory {out_dir!r}: "
                           f"{e.strerror or e}") from e
    # Everything is written under fresh temporary names first; the user's files at the final
    # names are touched only by the renames at the end (_publish), which undo themselves.
    staged: list[tuple[str, str]] = []  # (temporary, final)
    try:
        with phase(progress, total, "export") as p:
            for name, header, shard in zip(names, headers, shards, strict=True):
                tmp, f = _create_temp(out_dir, name)
                staged.append((tmp, os.path.join(out_dir, name)))
                with f:
                    f.write(header)
                    for t in shard:
                        x = _converted(source, t)  # one tensor in memory at a time
                        f.write(tensor_memoryview(x))
                        del x
                        p.advance(t.out_nbytes)
                    f.flush()
                    os.fsync(f.fileno())
        weight_map = {t.name: name for name, shard in zip(names, shards, strict=True)
                      for t in shard}
        tmp, f = _create_temp(out_dir, HF_INDEX_NAME)
        staged.append((tmp, os.path.join(out_dir, HF_INDEX_NAME)))  # last: it completes the set
        with f:
            f.write(index_bytes(weight_map, total))
            f.flush()
            os.fsync(f.fileno())
        _publish(staged, out_dir)
    except BaseException as e:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if created:  # a directory this export made goes too (rmdir: only while empty)
            with contextlib.suppress(OSError):
                os.rmdir(out_dir)
        if isinstance(e, OSError) and not isinstance(e, CkptmgrError):
            raise StorageError(f"writing the export into {out_dir!r} failed (the directory is "
                               f"as it was): {e.strerror or e}") from e
        raise
    return HfExportResult(out_dir, os.path.join(out_dir, HF_INDEX_NAME), tuple(names), step,
                          len(planned), total, tuple(skipped + dropped), source.prefix, left_out)


def _create_temp(dirpath: str, name: str) -> tuple[str, BinaryIO]:
    """A new, empty file for ``name`` under a temporary name in ``dirpath``, and its handle.

    Created exclusively (never an existing file or a symbolic link's target) with the usual
    permissions (0666 less the umask, as ``open`` would give the final file).
    """
    while True:
        path = os.path.join(dirpath, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                         0o666)
        except FileExistsError:
            continue
        return path, os.fdopen(fd, "wb")


def _publish(staged: list[tuple[str, str]], dirpath: str) -> None:
    """Rename each (temporary, final) pair into place, in order; if any rename fails, put back
    what was at the final names before (a hard link kept it) and re-raise."""
    done: list[tuple[str, str | None]] = []  # (final, its backup or None if it was new)
    try:
        for tmp, final in staged:
            backup, moved = None, False
            if os.path.lexists(final):
                backup = os.path.join(dirpath, f".{os.path.basename(final)}.bak-{os.getpid()}-"
                                               f"{secrets.token_hex(4)}")
                try:
                    os.link(final, backup, follow_symlinks=False)
                except OSError:  # no hard links here: move it aside (briefly absent)
                    os.replace(final, backup)
                    moved = True
            try:
                os.replace(tmp, final)
            except BaseException:
                # The final name still holds the old file (linked), or it was moved aside.
                with contextlib.suppress(OSError):
                    if moved:
                        os.replace(backup, final)  # type: ignore[arg-type]
                    elif backup is not None:
                        os.unlink(backup)
                raise
            done.append((final, backup))
    except BaseException:
        for final, backup in reversed(done):
            with contextlib.suppress(OSError):
                if backup is None:
                    os.unlink(final)
                else:
                    os.replace(backup, final)
        raise
    for _, backup in done:
        if backup is not None:
            with contextlib.suppress(OSError):
                os.unlink(backup)
    _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    """Make the renames in ``path`` durable (best effort: not every platform opens a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _converted(source: _TensorSource, t: _Planned) -> torch.Tensor:
    x = source.tensor(t.key, t.meta)
    if x.dtype != t.out_dtype:
        x = x.to(t.out_dtype)
    return x.contiguous()
