"""The ``Storage`` protocol: the narrow interface every checkpoint byte goes through.

``Storage`` is what every backend has (local disk and object stores alike). What only some have is
an optional capability, a protocol of its own checked with ``isinstance`` (never by probing for a
method): :class:`AtomicRename` (POSIX directories), :class:`RangeReads` (an open file read by
ranges), :class:`StreamReads` (many ranges streamed in order, read ahead by the storage) and, on
the writers, :class:`VectoredWriter`. A wrapper around a storage declares exactly the
capabilities of what it wraps (``tests/_faulty.py`` shows how), so a check never finds a method
that would fail.

Paths are ``str`` relative to the storage root, '/'-separated (``pathlib`` would mangle ``gs://``).
Every method raises :class:`ckptmgr.errors.StorageError` naming the object, with the backend's
exception as ``__cause__``; nothing else escapes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ckptmgr._redact import redact_url
from ckptmgr.errors import StorageError

__all__ = [
    "AtomicRename",
    "RangeReader",
    "RangeReads",
    "RootEntry",
    "StreamReads",
    "Storage",
    "StorageWriter",
    "VectoredWriter",
    "is_not_found",
    "redact_url",
]


def is_not_found(err: BaseException) -> bool:
    """Whether a StorageError (or its cause) says the object does not exist."""
    cause = err.__cause__ if isinstance(err, StorageError) else err
    return isinstance(cause, FileNotFoundError) or isinstance(err, FileNotFoundError)


@dataclass(frozen=True)
class RootEntry:
    """One top-level entry of a root: a directory (prefix) name and whether it holds the marker."""

    name: str
    is_dir: bool
    is_symlink: bool
    has_marker: bool


@runtime_checkable
class StorageWriter(Protocol):
    """A file being written: ``write`` chunks, then ``commit`` (durable) or ``abort`` (removed)."""

    def write(self, data: memoryview | bytes) -> None:
        """Append ``data``."""

    def commit(self) -> None:
        """Make the file durable (fsync where the backend has it) and close it."""

    def abort(self) -> None:
        """Close and remove the partial file; never raises."""


@runtime_checkable
class VectoredWriter(StorageWriter, Protocol):
    """Capability of a writer: append several buffers in one call, sparing the caller a join."""

    def writev(self, bufs: Sequence[memoryview | bytes]) -> None:
        """Append each of ``bufs`` in order."""


class RangeReader(Protocol):
    """One file opened for repeated range reads; close it (or use it as a context manager)."""

    def readv_into(self, offset: int, bufs: Sequence[memoryview]) -> None:
        """Fill ``bufs`` in order with the file's bytes from ``offset`` on.

        Raises:
            StorageError: the read failed or the file ends early.
        """

    def close(self) -> None:
        """Release the file and any read-ahead buffers; idempotent, never raises."""

    def __enter__(self) -> RangeReader: ...

    def __exit__(self, *exc: object) -> None: ...


@runtime_checkable
class Storage(Protocol):
    """A checkpoint root on some backend: what every backend has."""

    url: str
    """The root URL with credentials redacted: safe for logs and messages."""

    def scan_root(self, marker: str) -> list[RootEntry]:
        """Top-level entries of the root, with whether ``<entry>/<marker>`` exists.

        Costs O(1) list calls on object stores; never follows symlinks. An absent root is empty.
        """

    def list_files(self, path: str) -> dict[str, int]:
        """Files directly under directory ``path``: name -> size. Absent directory -> {}."""

    def list_dirs(self, path: str) -> list[str]:
        """Names of the entries directly under ``path`` that are not regular files
        (sub-directories, prefixes, links), sorted. Absent directory -> []."""

    def exists(self, path: str) -> bool:
        """Whether a file or directory exists at ``path``."""

    def size(self, path: str) -> int:
        """The size in bytes of file ``path``."""

    def read_bytes(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        """Bytes ``[start, start+length)`` of ``path`` (to the end when ``length`` is None)."""

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` exactly with the bytes of ``path`` starting at ``offset``."""

    def open_writer(self, path: str, size_hint: int | None = None) -> StorageWriter:
        """A new file at ``path`` (replacing any), written by chunks; ``size_hint``: about how
        many bytes will be written (lets an implementation size its buffers), None if unknown."""

    def write_bytes(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write a whole small file atomically (readers see all of it or none).

        Args:
            exclusive: fail with StorageError (cause FileExistsError) if ``path`` exists.
        """

    def makedirs(self, path: str) -> None:
        """Create directory ``path`` and its parents (no-op on object stores)."""

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, or a directory tree with ``recursive``; absent is not an error."""

    def is_symlink(self, path: str) -> bool:
        """Whether ``path`` is a symbolic link (always False on object stores)."""


@runtime_checkable
class AtomicRename(Storage, Protocol):
    """Capability of a POSIX file system: a directory is renamed into place atomically, after its
    entries were made durable. Object stores have no rename: there the manifest object, written
    last, is the commit (DESIGN.md section 5)."""

    def rename(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst`` atomically; never replaces a non-empty directory."""

    def fsync_dir(self, path: str) -> None:
        """Make the directory entries under ``path`` durable."""


@runtime_checkable
class RangeReads(Storage, Protocol):
    """Capability: a file opened once and read by many ranges (a kept descriptor, read-ahead),
    cheaper than one :meth:`Storage.read_into` per range."""

    def open_reader(self, path: str) -> RangeReader:
        """``path`` opened for range reads."""


@runtime_checkable
class StreamReads(Storage, Protocol):
    """Capability: many ranges, of one or more files, read ahead by the storage and delivered in
    order (local files: direct reads into huge-page buffers, ``ckptmgr/storage/_stream.py``)."""

    def stream_into(self, requests: Sequence[tuple[str, int, memoryview]]
                    ) -> Iterator[int] | None:
        """Fill each ``(path, offset, buffer)`` request's buffer with the file's bytes from
        ``offset`` on, yielding each request's index once its buffer is whole, in order; None
        when the storage would not read these faster than :class:`RangeReads` does (the caller
        reads them that way). Close the iterator when stopping early.

        Raises:
            StorageError: (while iterating) a read failed or a file ends early.
        """
