"""The DCP core: our StorageWriter/StorageReader over :mod:`ckptmgr.storage`, planners, the state
flattening that keeps Python values out of pickle, the model/optimizer ``Stateful`` for FSDP2, HSDP,
DDP and plain models, and the compatibility report of a restore.

Usable without the manager, under plain ``torch.distributed.checkpoint`` (docs/dcp.md):
``CkptStorageWriter(url)`` / ``CkptStorageReader(url)`` as DCP's storage layer,
``SpmdSavePlanner()`` / ``SpmdLoadPlanner()`` where torch_xla's SPMD planners were used,
``ModelOptimizerState`` for a model and its optimizers, and ``compatibility_report`` to ask what a
restore would change. These are the package's whole surface; ckptmgr's own modules import from
the defining modules (``ckptmgr.dcp.writer``, ``ckptmgr.dcp.metadata``, ...)."""

from ckptmgr.dcp.fsdp import ModelOptimizerState
from ckptmgr.dcp.reader import CkptStorageReader
from ckptmgr.dcp.report import CompatibilityReport, compatibility_report
from ckptmgr.dcp.spmd import SpmdLoadPlanner, SpmdSavePlanner
from ckptmgr.dcp.writer import CkptStorageWriter

__all__ = [
    "CkptStorageReader",
    "CkptStorageWriter",
    "CompatibilityReport",
    "ModelOptimizerState",
    "SpmdLoadPlanner",
    "SpmdSavePlanner",
    "compatibility_report",
]
