"""Thin wrappers over ``torch.distributed.checkpoint.save``/``load`` for torch 2.9 and newer.

Without a process group DCP warns on every call that it assumes a single process; that is exactly
our intent, so the warning is silenced here (and only that one).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

__all__ = ["dcp_load", "dcp_save"]

_SINGLE_PROCESS_WARNING = r"torch\.distributed is (disabled, )?unavailable or uninitialized"


def dcp_save(flat: dict[str, Any], writer: StorageWriter, planner: SavePlanner,
             group: Any) -> Metadata:
    """``dcp.save`` over ``group`` (None: this process alone)."""
    if group is not None:
        return dcp.save(flat, storage_writer=writer, planner=planner, process_group=group)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        return dcp.save(flat, storage_writer=writer, planner=planner, no_dist=True)


def dcp_load(flat: dict[str, Any], reader: StorageReader, planner: LoadPlanner,
             group: Any) -> None:
    """``dcp.load`` over ``group`` (None: this process alone), in place into ``flat``."""
    if group is not None:
        dcp.load(flat, storage_reader=reader, planner=planner, process_group=group)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        dcp.load(flat, storage_reader=reader, planner=planner, no_dist=True)
