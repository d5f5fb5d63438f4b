"""Hugging Face model directories, as ``load_initial`` reads them: an index
(``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``) naming shard files, or
``model.safetensors`` / ``pytorch_model.bin``, or some ``*.safetensors`` files; and the dispatch
from a source path to its reader (:func:`is_file_source`, :func:`read_file_source`).

An index may name only plain file names in its directory; a tensor named in two files is an
error. ``ckptmgr export --format hf`` writes the same layout: :func:`shard_file_names`, and the
index by :func:`index_bytes`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping

from ckptmgr.errors import ConfigError, UnsafeCheckpointError
from ckptmgr.formats.files import SourceTensor, open_regular, parse_json
from ckptmgr.formats.safetensors import read_safetensors
from ckptmgr.formats.torch_save import read_torch_file

__all__ = ["HF_INDEX_NAME", "index_bytes", "index_files", "is_file_source", "read_directory",
           "read_file_source", "shard_file_names"]

HF_INDEX_NAME = "model.safetensors.index.json"  # the name transformers looks for
_PT_INDEX_NAME = "pytorch_model.bin.index.json"
_MAX_INDEX = 100 * 1024 * 1024  # an index file (a few MB for the largest models)
_PT_SUFFIXES = (".pt", ".pth", ".bin")


def index_files(index: str, path: str) -> list[str]:
    """The shard files a Hugging Face index names, each a plain file name inside ``path``.

    Raises:
        ConfigError: the index is not a JSON object whose ``weight_map`` maps names to names.
        UnsafeCheckpointError: a shard name is not a plain file name (a path, ``.`` or ``..``).
    """
    with open_regular(index, "index file") as f:
        raw = f.read(_MAX_INDEX + 1)
    if len(raw) > _MAX_INDEX:
        raise ConfigError(f"{index} is larger than {_MAX_INDEX} bytes; not a Hugging Face index")
    doc = parse_json(raw, index, "Hugging Face index (JSON)")
    weight_map = doc.get("weight_map", {}) if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"{index} is not a Hugging Face index: expected a JSON object whose "
                          "'weight_map' maps tensor names to file names")
    files = sorted(set(weight_map.values()))
    for name in files:
        if (name in ("", ".", "..") or "\0" in name or os.path.basename(name) != name
                or (os.altsep is not None and os.altsep in name)):
            raise UnsafeCheckpointError(f"{index} names {name!r}, which is not a file name "
                                        f"inside {path}")
    return files


def _read_all(path: str, files: list[str], reader: Callable[[str], list[SourceTensor]],
              ) -> list[SourceTensor]:
    """The tensors of ``files`` in ``path``; a name in two files is ambiguous, so an error."""
    out: list[SourceTensor] = []
    where: dict[str, str] = {}
    for name in files:
        for t in reader(os.path.join(path, name)):
            if t.name in where:
                raise ConfigError(f"{path}: tensor {t.name!r} is in both {where[t.name]} and "
                                  f"{name}; remove one")
            where[t.name] = name
            out.append(t)
    return out


def read_directory(path: str) -> list[SourceTensor]:
    """The tensors of a Hugging Face model directory."""
    for index_name, reader in ((HF_INDEX_NAME, read_safetensors),
                               (_PT_INDEX_NAME, read_torch_file)):
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            return _read_all(path, index_files(index, path), reader)
    for single, reader in (("model.safetensors", read_safetensors),
                           ("pytorch_model.bin", read_torch_file)):
        if os.path.isfile(os.path.join(path, single)):
            return reader(os.path.join(path, single))
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    return _read_all(path, files, read_safetensors)


def is_file_source(path: str) -> bool:
    if os.path.exists(path) and not os.path.isdir(path) and path.endswith(
            (".safetensors", *_PT_SUFFIXES)):
        return True  # a weights file, or a FIFO or device so named: refused when opened
    return os.path.isfile(path) or (os.path.isdir(path) and any(
        f.endswith((".safetensors", ".index.json")) or f == "pytorch_model.bin"
        for f in os.listdir(path)))


def read_file_source(path: str) -> list[SourceTensor]:
    if os.path.isdir(path):
        tensors = read_directory(path)
    elif path.endswith(".safetensors"):
        tensors = read_safetensors(path)
    elif path.endswith(_PT_SUFFIXES):
        tensors = read_torch_file(path)
    else:
        raise ConfigError(f"source {path!r} must be a .safetensors, .pt, .pth or .bin file, a "
                          "Hugging Face directory or a ckptmgr root")
    if not tensors:
        raise ConfigError(f"source {path!r} holds no tensors")
    return tensors


def shard_file_names(count: int) -> list[str]:
    """The names ``transformers``' ``save_pretrained`` gives ``count`` safetensors shards."""
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def index_bytes(weight_map: Mapping[str, str], total_size: int) -> bytes:
    """The index file (:data:`HF_INDEX_NAME`) naming each tensor's shard, as
    :func:`index_files` reads it back."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    return json.dumps(index, indent=2, sort_keys=True).encode("utf-8") + b"\n"
