"""The DCP core: our StorageWriter/StorageReader over :mod:`ckptmgr.storage`, planners, and the
state flattening that keeps Python values out of pickle."""

from ckptmgr.dcp.planner import CkptLoadPlanner, CkptSavePlanner
from ckptmgr.dcp.reader import CkptStorageReader
from ckptmgr.dcp.writer import CkptStorageWriter, CommitPlan

__all__ = [
    "CkptLoadPlanner",
    "CkptSavePlanner",
    "CkptStorageReader",
    "CkptStorageWriter",
    "CommitPlan",
]
