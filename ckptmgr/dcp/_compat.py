"""Thin wrappers over ``torch.distributed.checkpoint.save``/``load`` for torch 2.9 and newer.

Without a process group DCP warns on every call that it assumes a single process; that is exactly
our intent, so the warning is silenced here (and only that one).
"""

from __future__ import annotations

import warnings
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as _dcp_save
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

__all__ = ["dcp_load", "dcp_save"]

_SINGLE_PROCESS_WARNING = r"torch\.distributed is (disabled, )?unavailable or uninitialized"


def dcp_save(flat: dict[str, Any], writer: StorageWriter, planner: SavePlanner,
             group: Any) -> Metadata:
    """``dcp.save`` over ``group`` (None: this process alone)."""
    if group is not None:
        md: Metadata = _dcp_save(flat, storage_writer=writer, planner=planner,
                                 process_group=group)
        return md
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        md = _dcp_save(flat, storage_writer=writer, planner=planner, no_dist=True)
        return md


def dcp_load(flat: dict[str, Any], reader: StorageReader, planner: LoadPlanner,
             group: Any) -> None:
    """``dcp.load`` over ``group`` (None: this process alone), in place into ``flat``."""
    if group is not None:
        _dcp_load(flat, storage_reader=reader, planner=planner, process_group=group)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        _dcp_load(flat, storage_reader=reader, planner=planner, no_dist=True)
