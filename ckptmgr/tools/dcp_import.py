"""Importing a checkpoint written by plain DCP as a committed step of a ckptmgr root.

The DCP side (reading the source lazily, re-nesting its flat items) is
:mod:`ckptmgr.dcp.importer`; this module checks the source and the destination, and writes the step
through ckptmgr's own writer and commit.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ckptmgr.codec.layout import check_step, step_dir_name
from ckptmgr.dcp.compat import dcp_load, dcp_save
from ckptmgr.dcp.importer import CachedMetadataReader, LazyImportPlanner, nest_items
from ckptmgr.dcp.state import flatten_state
from ckptmgr.dcp.writer import CkptStorageWriter
from ckptmgr.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    SaveError,
    UnsafeCheckpointError,
)
from ckptmgr.info import StepInfo
from ckptmgr.lease import writer_lease
from ckptmgr.step_store import StepStore
from ckptmgr.storage import open_storage, redact_url
from ckptmgr.tools._common import (
    Progress,
    _element_size,
    _numel,
    _phase,
)

__all__ = ["import_dcp"]

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
    total = sum(_numel(m.size) * _element_size(m.properties.dtype) for m in metas.values())
    with writer_lease(storage) as lease:
        store.fence = lease.check
        plan = store.begin_save(step, forced=True, overwrite=False, world_size=1,
                                metrics=metrics_d, metadata=meta_d)
        assert plan is not None, "a forced save is planned or refused, never skipped"
        writer = CkptStorageWriter.for_attempt(storage, plan, 0, trusted=True, fence=lease.check)
        try:
            with _phase(progress, total, "import") as p:
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
    for _rank, f in sorted(e.failures.items()):
        exc = f[0] if isinstance(f, tuple) else f
        return f"{type(exc).__name__}: {exc}"
    return str(e)
