"""The DCP core: our StorageWriter/StorageReader over :mod:`ckptmgr.storage`, planners, the state
flattening that keeps Python values out of pickle, the model/optimizer ``Stateful`` for FSDP2, HSDP,
DDP and plain models, and the compatibility report of a restore."""

from ckptmgr.dcp.fsdp import ModelOptimizerState
from ckptmgr.dcp.planner import CkptLoadPlanner, CkptSavePlanner
from ckptmgr.dcp.reader import CkptStorageReader
from ckptmgr.dcp.report import CompatibilityReport, compatibility_report
from ckptmgr.dcp.writer import CkptStorageWriter, CommitPlan

__all__ = [
    "CkptLoadPlanner",
    "CkptSavePlanner",
    "CkptStorageReader",
    "CkptStorageWriter",
    "CommitPlan",
    "CompatibilityReport",
    "ModelOptimizerState",
    "compatibility_report",
]
