"""The DCP core: our StorageWriter/StorageReader over :mod:`ckptmgr.storage`, planners, the state
flattening that keeps Python values out of pickle, the model/optimizer ``Stateful`` for FSDP2, HSDP,
DDP and plain models, the compatibility report of a restore, and the byte-level pieces the layers
above read checkpoints with (checksums, tensor byte views, the JSON metadata codec, DCP's save and
load entry points).

Usable without the manager, under plain ``torch.distributed.checkpoint`` (docs/dcp.md):
``CkptStorageWriter(url)`` / ``CkptStorageReader(url)`` as DCP's storage layer, and
``SpmdSavePlanner()`` / ``SpmdLoadPlanner()`` where torch_xla's SPMD planners were used."""

from ckptmgr.dcp._compat import dcp_load, dcp_save
from ckptmgr.dcp._metadata_json import ItemLocation, decode_metadata, dtype_name, encode_metadata
from ckptmgr.dcp.fsdp import ModelOptimizerState
from ckptmgr.dcp.planner import CkptLoadPlanner, CkptSavePlanner
from ckptmgr.dcp.reader import CkptStorageReader
from ckptmgr.dcp.report import CompatibilityReport, compatibility_report
from ckptmgr.dcp.spmd import SpmdLoadPlanner, SpmdSavePlanner
from ckptmgr.dcp.writer import CkptStorageWriter, CommitPlan

__all__ = [
    "CkptLoadPlanner",
    "CkptSavePlanner",
    "CkptStorageReader",
    "CkptStorageWriter",
    "CommitPlan",
    "CompatibilityReport",
    "ItemLocation",
    "ModelOptimizerState",
    "SpmdLoadPlanner",
    "SpmdSavePlanner",
    "compatibility_report",
    "dcp_load",
    "dcp_save",
    "decode_metadata",
    "dtype_name",
    "encode_metadata",
]
