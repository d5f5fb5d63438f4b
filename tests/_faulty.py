"""A fault-injecting fsspec file system for tests: ``faulty://`` over the in-memory store.

Real backends cannot be made to fail on demand; this wrapper can. ``FaultyFS.fail_data`` makes
every new data file fail to open with ENOSPC; ``FaultyFS.gate`` (a :class:`Gate`) holds every
data-file write at its open until the test opens the gate, so "a save is in flight" is a fact the
test arranged, not a guess about timing.

:class:`FaultyStorage` (made by :func:`wrap`) wraps any :class:`ckptmgr.storage.Storage` instead:
``fail_ops`` makes the named storage operations fail, and the wrapper has exactly the optional
capabilities of the storage it wraps.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

from ckptmgr.errors import StorageError
from ckptmgr.storage import (
    AtomicRename,
    RangeReader,
    RangeReads,
    RootEntry,
    Storage,
    StorageWriter,
    StreamReads,
    VectoredWriter,
)

# A gate left shut by a broken test fails that test instead of hanging the suite.
GATE_TIMEOUT_S = 120.0


class Gate:
    """Holds the threads that reach it until :meth:`open`; records that one arrived."""

    def __init__(self) -> None:
        self._arrived = threading.Event()
        self._opened = threading.Event()

    def pass_(self) -> None:
        """(the held thread) Say it arrived, then wait until the gate opens."""
        self._arrived.set()
        if not self._opened.wait(GATE_TIMEOUT_S):
            raise TimeoutError(f"the test never opened the gate ({GATE_TIMEOUT_S} s)")

    def wait_arrived(self) -> None:
        """(the test) Block until a thread is held at the gate."""
        if not self._arrived.wait(GATE_TIMEOUT_S):
            raise TimeoutError(f"nothing reached the gate in {GATE_TIMEOUT_S} s")

    def open(self) -> None:
        """(the test) Let every held thread, and every later one, through."""
        self._opened.set()


class FaultyFS(MemoryFileSystem):  # type: ignore[misc]
    """The memory file system with switchable faults on data files."""

    protocol = "faulty"
    fail_data: ClassVar[bool] = False
    gate: ClassVar[Gate | None] = None

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if ("w" in mode or "x" in mode) and "/data-" in path:
            if self.gate is not None:
                self.gate.pass_()
            if self.fail_data:
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        return super()._open(path, mode=mode, **kwargs)


def install() -> type[FaultyFS]:
    """Register ``faulty://`` with fsspec and reset its switches."""
    fsspec.register_implementation("faulty", FaultyFS, clobber=True)
    reset()
    return FaultyFS


def reset() -> None:
    """Switch every fault off (an open gate lets held threads go first)."""
    if FaultyFS.gate is not None:
        FaultyFS.gate.open()
    FaultyFS.fail_data = False
    FaultyFS.gate = None


def open_when_called(obj: Any, name: str, gate: Gate) -> None:
    """Open ``gate`` as ``obj.name(...)`` is entered (so whatever the gate holds is still in
    flight when that method starts), by wrapping the method on this one instance."""
    method = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        gate.open()
        return method(*args, **kwargs)

    setattr(obj, name, wrapper)


class FaultyStorage:
    """A :class:`ckptmgr.storage.Storage` wrapper: ``fail_ops`` names the operations that fail
    (with ENOSPC, as a full disk would); everything else goes to the wrapped storage.

    Make one with :func:`wrap`, never directly: the class it returns has exactly the optional
    capabilities of the wrapped storage (minus ``hide``), so ``isinstance`` checks on the wrapper
    answer what the wrapped storage can really do.
    """

    def __init__(self, inner: Storage, *, hide: frozenset[type] = frozenset()) -> None:
        self.inner = inner
        self.url = inner.url
        self.hide = hide
        self.fail_ops: set[str] = set()

    def __repr__(self) -> str:
        return f"FaultyStorage({self.inner!r})"

    @property
    def supports_rename(self) -> bool:
        """For callers written before :class:`AtomicRename`; remove with theirs."""
        return isinstance(self, AtomicRename)

    def _check(self, op: str, path: str) -> None:
        if op in self.fail_ops:
            raise StorageError(f"{op} failed for {self.url}/{path} (injected)") from OSError(
                errno.ENOSPC, "No space left on device (injected)", path)

    def scan_root(self, marker: str) -> list[RootEntry]:
        self._check("scan_root", "")
        return self.inner.scan_root(marker)

    def list_files(self, path: str) -> dict[str, int]:
        self._check("list_files", path)
        return self.inner.list_files(path)

    def list_dirs(self, path: str) -> list[str]:
        self._check("list_dirs", path)
        return self.inner.list_dirs(path)

    def exists(self, path: str) -> bool:
        self._check("exists", path)
        return self.inner.exists(path)

    def size(self, path: str) -> int:
        self._check("size", path)
        return self.inner.size(path)

    def read_bytes(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        self._check("read_bytes", path)
        return self.inner.read_bytes(path, start, length)

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        self._check("read_into", path)
        self.inner.read_into(path, offset, buf)

    def open_writer(self, path: str, size_hint: int | None = None) -> StorageWriter:
        self._check("open_writer", path)
        inner = self.inner.open_writer(path, size_hint)
        if isinstance(inner, VectoredWriter) and VectoredWriter not in self.hide:
            return _FaultyVectoredWriter(self, path, inner)
        return _FaultyWriter(self, path, inner)

    def write_bytes(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        self._check("write_bytes", path)
        self.inner.write_bytes(path, data, exclusive=exclusive)

    def makedirs(self, path: str) -> None:
        self._check("makedirs", path)
        self.inner.makedirs(path)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._check("remove", path)
        self.inner.remove(path, recursive=recursive)

    def is_symlink(self, path: str) -> bool:
        return self.inner.is_symlink(path)


class _AtomicRenameForwarding(FaultyStorage):
    inner: AtomicRename

    def rename(self, src: str, dst: str) -> None:
        self._check("rename", src)
        self.inner.rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        self._check("fsync_dir", path)
        self.inner.fsync_dir(path)


class _RangeReadsForwarding(FaultyStorage):
    inner: RangeReads

    def open_reader(self, path: str) -> RangeReader:
        self._check("open_reader", path)
        return self.inner.open_reader(path)


class _StreamReadsForwarding(FaultyStorage):
    inner: StreamReads

    def stream_into(self, requests: Sequence[tuple[str, int, memoryview]]) -> Iterator[int] | None:
        self._check("stream_into", requests[0][0] if requests else "")
        return self.inner.stream_into(requests)


class _FaultyWriter:
    def __init__(self, storage: FaultyStorage, path: str, inner: StorageWriter) -> None:
        self._storage = storage
        self._path = path
        self._inner = inner

    def write(self, data: memoryview | bytes) -> None:
        self._storage._check("write", self._path)
        self._inner.write(data)

    def commit(self) -> None:
        self._storage._check("commit", self._path)
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


class _FaultyVectoredWriter(_FaultyWriter):
    _inner: VectoredWriter

    def writev(self, bufs: Sequence[memoryview | bytes]) -> None:
        self._storage._check("writev", self._path)
        self._inner.writev(bufs)


# Each optional storage capability and the mixin that forwards it.
_FORWARDERS: tuple[tuple[type, type[FaultyStorage]], ...] = (
    (AtomicRename, _AtomicRenameForwarding),
    (RangeReads, _RangeReadsForwarding),
    (StreamReads, _StreamReadsForwarding),
)
_classes: dict[tuple[type, ...], type[FaultyStorage]] = {}


def wrap(inner: Storage, *, hide: Iterable[type] = ()) -> FaultyStorage:
    """``inner`` wrapped in a :class:`FaultyStorage` that has exactly ``inner``'s capabilities,
    less those in ``hide`` (e.g. ``hide=[RangeReads, VectoredWriter]``: a plainer backend)."""
    hidden = frozenset(hide)
    mixins = tuple(fwd for cap, fwd in _FORWARDERS if isinstance(inner, cap) and cap not in hidden)
    cls = _classes.get(mixins)
    if cls is None:
        cls = _classes[mixins] = (
            type("FaultyStorage", (*mixins, FaultyStorage), {}) if mixins else FaultyStorage)
    return cls(inner, hide=hidden)
