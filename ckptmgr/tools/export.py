"""Exporting one committed step into a single consolidated, weights-only file (safetensors or
``torch.save``'s format), tensor by tensor."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
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

__all__ = ["ExportResult", "export_step"]

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
        if lower.endswith((".pt", ".pth", ".bin")):
            return "pt"
        raise ConfigError(f"output {out!r} must end in .safetensors, .pt or .pth, or the "
                          "format must be given")
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
    storage = open_storage(url, storage_options, writable=False)
    step = StepStore(storage).resolve(step)
    manifest, _ = StepStore(storage).read_manifest_bytes(step)
    if manifest.byteorder != sys.byteorder:
        raise ConfigError(f"step {step} was written on a {manifest.byteorder}-endian host; "
                          f"this host is {sys.byteorder}-endian")
    md = read_step_metadata(StepStore(storage), step, manifest)
    planned, skipped = _select(md, only, cast)
    source = _TensorSource(storage, step, manifest, md)
    source.check_files((t.key, t.meta) for t in planned)
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


def _converted(source: _TensorSource, t: _Planned) -> torch.Tensor:
    x = source.tensor(t.key, t.meta)
    if x.dtype != t.out_dtype:
        x = x.to(t.out_dtype)
    return x.contiguous()
