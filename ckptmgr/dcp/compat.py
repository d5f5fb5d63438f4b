"""Thin wrappers over DCP's save and load for torch 2.9 and newer.

The public ``torch.distributed.checkpoint.save`` first replaces every ``Stateful`` value by its
``state_dict()``, wrapping each top-level key in a logging decorator: 40-120 ms per save for 816
keys measured here, on a state we have already flattened (``ckptmgr.dcp.state`` resolves Stateful
objects itself, so the flat dicts passed here never hold one). When DCP's private
``_save_state_dict`` / ``_load_state_dict`` exist with the signature we checked, they are called
directly; otherwise the public functions are, with the same results.

Without a process group DCP's public functions warn on every call that they assume a single
process; that is exactly our intent, so the warning is silenced here (and only that one).

Private torch names are imported in this module only, each guarded, with the versions that have it.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint import state_dict_loader as _loader
from torch.distributed.checkpoint import state_dict_saver as _saver
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

__all__ = ["dcp_load", "dcp_save", "fsspec_reader", "uses_private_entry_points"]

_SINGLE_PROCESS_WARNING = r"torch\.distributed is (disabled, )?unavailable or uninitialized"

# The keyword arguments we pass; a private function is used only when it takes all of them.
_SAVE_PARAMS = ("state_dict", "storage_writer", "process_group", "no_dist", "planner")
_LOAD_PARAMS = ("state_dict", "storage_reader", "process_group", "no_dist", "planner")


def _private(module: Any, name: str, params: tuple[str, ...]) -> Callable[..., Any] | None:
    """``module.name`` when it exists and accepts every keyword in ``params``, else None."""
    fn: Callable[..., Any] | None = getattr(module, name, None)
    if not callable(fn):
        return None
    try:
        accepted = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if not all(p in accepted for p in params):
        return None
    return fn


# torch.distributed.checkpoint.state_dict_saver._save_state_dict(state_dict, storage_writer,
# process_group=None, coordinator_rank=0, no_dist=False, planner=None, use_collectives=True):
# same signature in torch 2.9.0 and 2.13.0 (checked in both).
_save_state_dict = _private(_saver, "_save_state_dict", _SAVE_PARAMS)
# torch.distributed.checkpoint.state_dict_loader._load_state_dict(state_dict, storage_reader,
# process_group=None, coordinator_rank=0, no_dist=False, planner=None): same in 2.9.0 and 2.13.0.
_load_state_dict = _private(_loader, "_load_state_dict", _LOAD_PARAMS)


def uses_private_entry_points() -> tuple[bool, bool]:
    """Whether saves and loads go through DCP's private functions (True) or the public ones."""
    return _save_state_dict is not None, _load_state_dict is not None


def dcp_save(flat: dict[str, Any], writer: StorageWriter, planner: SavePlanner,
             group: Any) -> Metadata:
    """DCP's save of ``flat`` (no Stateful values) over ``group`` (None: this process alone).

    Collective over ``group``. Raises DCP's ``CheckpointException`` for a failure on any rank.
    """
    no_dist = group is None
    if _save_state_dict is not None:
        md: Metadata = _save_state_dict(state_dict=flat, storage_writer=writer,
                                        process_group=group, no_dist=no_dist, planner=planner)
        return md
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        md = _saver.save(flat, storage_writer=writer, planner=planner, process_group=group,
                         no_dist=no_dist)
        return md


def dcp_load(flat: dict[str, Any], reader: StorageReader, planner: LoadPlanner,
             group: Any) -> None:
    """DCP's load into ``flat`` (no Stateful values) in place, over ``group`` (None: alone).

    Collective over ``group``. Keys are visited in sorted order on every rank, as DCP's public
    ``load`` does; values a loader replaces are written back into ``flat``.
    """
    no_dist = group is None
    if _load_state_dict is not None:
        ordered = {k: flat[k] for k in sorted(flat)}
        _load_state_dict(state_dict=ordered, storage_reader=reader, process_group=group,
                         no_dist=no_dist, planner=planner)
        flat.update(ordered)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        _loader.load(flat, storage_reader=reader, planner=planner, process_group=group,
                     no_dist=no_dist)


def fsspec_reader(url: str, options: dict[str, Any]) -> StorageReader:
    """DCP's own ``FsspecReader`` (the reader torch_xla's manager uses) for ``url``.

    torch 2.9 through 2.14 keep it in the private ``_fsspec_filesystem`` module, with the
    signature ``FsspecReader(path, **storage_options)``; imported here only, when first needed.
    """
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    reader: StorageReader = FsspecReader(url, **options)
    return reader
