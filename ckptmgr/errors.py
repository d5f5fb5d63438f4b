"""The ckptmgr exception hierarchy.

Every error raised by a public ckptmgr call is a :class:`CkptmgrError` and also subclasses the
builtin it resembles, so ``except ValueError`` or ``except OSError`` keep working::

    CkptmgrError(Exception)
    ├── ConfigError(ValueError)                bad argument or config: names the field, value, rule
    ├── BackendNotInstalledError(ImportError)  an fsspec backend is missing: says what to install
    ├── StorageError(OSError)                  I/O failed; names the object; original as __cause__
    ├── CheckpointNotFoundError(LookupError)   unknown step; lists the available ones
    │   └── IncompleteCheckpointError          the step exists but never committed
    ├── CheckpointExistsError(FileExistsError) the step is already committed
    ├── LeaseError(RuntimeError)               another live writer holds the root, or this
    │                                          writer lost its lease (fenced)
    ├── SaveError(RuntimeError)                .step, .failures {rank: exception}
    │   └── AsyncSaveError                     raised once by the next save/save_async/join/close
    └── RestoreError(RuntimeError)             .step
        ├── StateMismatchError(ValueError)     missing keys, shape or dtype mismatches, listed
        ├── CorruptCheckpointError             size or checksum mismatch, unreadable metadata
        └── UnsafeCheckpointError              would need pickle, or a path escapes the step
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = [
    "AsyncSaveError",
    "BackendNotInstalledError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CkptmgrError",
    "ConfigError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "LeaseError",
    "RestoreError",
    "SaveError",
    "StateMismatchError",
    "StorageError",
    "UnsafeCheckpointError",
]


class CkptmgrError(Exception):
    """Base class of every error raised by ckptmgr."""


class ConfigError(CkptmgrError, ValueError):
    """An argument or config value is invalid; the message names field, value and rule."""


class BackendNotInstalledError(CkptmgrError, ImportError):
    """The fsspec backend for a URL scheme is not installed; the message says what to install."""


class StorageError(CkptmgrError, OSError):
    """A storage operation failed; the message names the object, the original is ``__cause__``."""


class CheckpointNotFoundError(CkptmgrError, LookupError):
    """The requested step is not a committed checkpoint; the message lists the available steps."""

    def __init__(self, message: str, *, step: int | None = None,
                 available: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.available = list(available)


class IncompleteCheckpointError(CheckpointNotFoundError):
    """The step's directory exists but its save never committed (no manifest)."""


class CheckpointExistsError(CkptmgrError, FileExistsError):
    """The step is already committed; pass ``overwrite=True`` to replace it."""


class LeaseError(CkptmgrError, RuntimeError):
    """Another live writer holds the root's writer lease (the message names it, when it expires
    and the way out), or this writer lost its lease to another and may no longer commit."""


class SaveError(CkptmgrError, RuntimeError):
    """A save failed on one or more ranks.

    Attributes:
        step: the step that was being saved.
        failures: rank -> the exception raised on that rank (as seen by this rank).
        phase: where a collective failed or timed out ("plan", "write", "commit"), else None.
        missing_ranks: the ranks that did not arrive at that collective (killed, stuck).
    """

    def __init__(self, message: str, *, step: int | None = None,
                 failures: Mapping[int, BaseException] | None = None,
                 phase: str | None = None, missing_ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.failures: dict[int, BaseException] = dict(failures or {})
        self.phase = phase
        self.missing_ranks = list(missing_ranks)


class AsyncSaveError(SaveError):
    """A background save failed; raised once by the next save/save_async/join/close."""


class RestoreError(CkptmgrError, RuntimeError):
    """A restore failed.

    Attributes:
        step: the step that was being restored.
        phase: "restore" when a collective failed or timed out, else None.
        missing_ranks: the ranks that did not arrive at that collective (killed, stuck).
    """

    def __init__(self, message: str, *, step: int | None = None, phase: str | None = None,
                 missing_ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.phase = phase
        self.missing_ranks = list(missing_ranks)


class StateMismatchError(RestoreError, ValueError):
    """The given state dict does not match the checkpoint: missing keys, shapes or dtypes.

    Attributes:
        missing: keys requested but absent from the checkpoint.
        mismatches: human-readable lines, one per shape or dtype mismatch.
    """

    def __init__(self, message: str, *, step: int | None = None,
                 missing: Sequence[str] = (), mismatches: Sequence[str] = ()) -> None:
        super().__init__(message, step=step)
        self.missing = list(missing)
        self.mismatches = list(mismatches)


class CorruptCheckpointError(RestoreError):
    """A file's size or checksum does not match the manifest, or metadata cannot be read.

    Attributes:
        path: the offending file, relative to the step directory, when known.
    """

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None) -> None:
        super().__init__(message, step=step)
        self.path = path


class UnsafeCheckpointError(RestoreError):
    """Loading would need pickle without ``trusted=True``, or a path escapes the step directory."""
