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

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptmgr._version import __version__
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

if TYPE_CHECKING:
    from ckptmgr.config import ManagerConfig
    from ckptmgr.info import FileEntry, SaveStats, StepInfo
    from ckptmgr.manager import CheckpointManager
    from ckptmgr.optim import prime_optimizer
    from ckptmgr.rng import RNGState

# Imported on first use (PEP 562): ``import ckptmgr`` and the ``ckptmgr`` command line start
# without torch, pydantic or fsspec; the first touch of one of these names imports its module.
_LAZY = {
    "CheckpointManager": "ckptmgr.manager",
    "FileEntry": "ckptmgr.info",
    "ManagerConfig": "ckptmgr.config",
    "RNGState": "ckptmgr.rng",
    "SaveStats": "ckptmgr.info",
    "StepInfo": "ckptmgr.info",
    "prime_optimizer": "ckptmgr.optim",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptmgr' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
    "RNGState",
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
