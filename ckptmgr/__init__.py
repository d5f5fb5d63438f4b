"""ckptmgr: take checkpointing off the critical path of PyTorch training.

Quick start::

    import ckptmgr

    mgr = ckptmgr.CheckpointManager("/tmp/run-7", save_interval=100, max_to_keep=3)
    if mgr.all_steps():
        mgr.restore(max(mgr.all_steps()), state)
    for step in range(start, total):
        mgr.save_async(step, state)   # saves only when due
    mgr.close()
"""

from ckptmgr._version import __version__
from ckptmgr.config import ManagerConfig
from ckptmgr.errors import (
    AsyncSaveError,
    BackendNotInstalledError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptmgrError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    RestoreError,
    SaveError,
    StateMismatchError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptmgr.info import FileEntry, SaveStats, StepInfo
from ckptmgr.manager import CheckpointManager
from ckptmgr.optim import prime_optimizer

__all__ = [
    "AsyncSaveError",
    "BackendNotInstalledError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CkptmgrError",
    "ConfigError",
    "CorruptCheckpointError",
    "FileEntry",
    "IncompleteCheckpointError",
    "ManagerConfig",
    "RestoreError",
    "SaveError",
    "SaveStats",
    "StateMismatchError",
    "StepInfo",
    "StorageError",
    "UnsafeCheckpointError",
    "__version__",
    "prime_optimizer",
]
