"""Local-disk storage on POSIX calls: fsync of files and directories, atomic renames."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from typing import TypeVar

from ckptmgr.errors import StorageError
from ckptmgr.storage.base import RootEntry

__all__ = ["LocalStorage"]

T = TypeVar("T")
_CHUNK = 64 * 1024 * 1024
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class _LocalWriter:
    def __init__(self, storage: LocalStorage, path: str) -> None:
        self._storage = storage
        self._path = path
        self._abs = storage.abspath(path)
        self._fd: int | None = storage._call(
            "open for writing", path,
            lambda: os.open(self._abs, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o644))

    def write(self, data: memoryview | bytes) -> None:
        assert self._fd is not None, "write after commit/abort"
        mv = memoryview(data).cast("B")
        fd = self._fd

        def _write() -> None:
            pos = 0
            while pos < len(mv):
                pos += os.write(fd, mv[pos:pos + _CHUNK])

        self._storage._call("write", self._path, _write)

    def commit(self) -> None:
        assert self._fd is not None, "commit after commit/abort"
        fd, self._fd = self._fd, None
        try:
            self._storage._call("fsync", self._path, lambda: os.fsync(fd))
        finally:
            os.close(fd)

    def abort(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            os.unlink(self._abs)


class LocalStorage:
    """A checkpoint root on a local (POSIX) file system."""

    supports_rename = True

    def __init__(self, root: str, *, display_url: str | None = None) -> None:
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = display_url or self.root

    def __repr__(self) -> str:
        return f"LocalStorage({self.url!r})"

    def abspath(self, path: str) -> str:
        """The absolute OS path of relative ``path``."""
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except OSError as e:
            where = f"{self.url}/{path}" if path else self.url
            raise StorageError(f"{what} failed for {where}: {e.strerror or e}") from e

    def scan_root(self, marker: str) -> list[RootEntry]:
        def _scan() -> list[RootEntry]:
            if not os.path.isdir(self.root):
                return []
            out = []
            with os.scandir(self.root) as it:
                for e in it:
                    link = e.is_symlink()
                    is_dir = e.is_dir(follow_symlinks=False)
                    has = False
                    if is_dir:
                        try:
                            st = os.lstat(os.path.join(e.path, marker))
                            has = stat.S_ISREG(st.st_mode)
                        except FileNotFoundError:
                            has = False
                    out.append(RootEntry(e.name, is_dir, link, has))
            return out

        return self._call("list", "", _scan)

    def list_files(self, path: str) -> dict[str, int]:
        def _ls() -> dict[str, int]:
            d = self.abspath(path)
            if not os.path.isdir(d):
                return {}
            out = {}
            with os.scandir(d) as it:
                for e in it:
                    if e.is_file(follow_symlinks=False):
                        out[e.name] = e.stat(follow_symlinks=False).st_size
            return out

        return self._call("list", path, _ls)

    def exists(self, path: str) -> bool:
        return os.path.lexists(self.abspath(path))

    def size(self, path: str) -> int:
        return self._call("stat", path, lambda: os.lstat(self.abspath(path)).st_size)

    @contextlib.contextmanager
    def _open_read(self, path: str) -> Iterator[int]:
        fd = self._call("open", path, lambda: os.open(self.abspath(path), os.O_RDONLY | _NOFOLLOW))
        try:
            yield fd
        finally:
            os.close(fd)

    def read_bytes(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        with self._open_read(path) as fd:
            if length is None:
                length = max(0, os.fstat(fd).st_size - start)
            buf = bytearray(length)
            self._read_fd(fd, path, start, memoryview(buf))
            return bytes(buf)

    def _read_fd(self, fd: int, path: str, offset: int, buf: memoryview) -> None:
        mv = buf.cast("B")

        def _read() -> None:
            pos = 0
            while pos < len(mv):
                n = os.preadv(fd, [mv[pos:pos + _CHUNK]], offset + pos)
                if n == 0:
                    raise EOFError(f"file ends at byte {offset + pos}, wanted {offset + len(mv)}")
                pos += n

        try:
            self._call("read", path, _read)
        except EOFError as e:
            raise StorageError(f"read failed for {self.url}/{path}: {e}") from e

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        with self._open_read(path) as fd:
            self._read_fd(fd, path, offset, buf)

    def open_writer(self, path: str) -> _LocalWriter:
        return _LocalWriter(self, path)

    def write_bytes(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        final = self.abspath(path)
        tmp = f"{final}.tmp-{os.getpid()}-{id(data):x}"

        def _write() -> None:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
            try:
                mv = memoryview(data)
                pos = 0
                while pos < len(mv):
                    pos += os.write(fd, mv[pos:])
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                if exclusive:
                    # link() fails if the name exists: an atomic create-if-absent.
                    os.link(tmp, final)
                    os.unlink(tmp)
                else:
                    os.replace(tmp, final)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._fsync_dir_abs(os.path.dirname(final))

        self._call("write", path, _write)

    def makedirs(self, path: str) -> None:
        self._call("mkdir", path, lambda: os.makedirs(self.abspath(path), exist_ok=True))

    def rename(self, src: str, dst: str) -> None:
        def _rename() -> None:
            d = self.abspath(dst)
            if os.path.lexists(d) and not (os.path.isdir(d) and not os.listdir(d)):
                raise FileExistsError(f"rename target exists: {dst}")
            os.rename(self.abspath(src), d)

        self._call("rename", f"{src} -> {dst}", _rename)

    @staticmethod
    def _fsync_dir_abs(d: str) -> None:
        fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_dir(self, path: str) -> None:
        self._call("fsync", path, lambda: self._fsync_dir_abs(self.abspath(path)))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        def _rm() -> None:
            p = self.abspath(path)
            if not os.path.lexists(p):
                return
            if os.path.isdir(p) and not os.path.islink(p):
                if not recursive:
                    raise IsADirectoryError(p)
                shutil.rmtree(p)
            else:
                os.unlink(p)

        self._call("remove", path, _rm)

    def is_symlink(self, path: str) -> bool:
        return os.path.islink(self.abspath(path))
