"""Storage on any fsspec file system: memory://, gs:// (gcsfs), s3:// (s3fs) and the rest.

Object stores have no rename: a step is written in place under attempt-unique file names and the
manifest object, written last in one PUT, is the commit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

from ckptmgr.errors import StorageError
from ckptmgr.storage.base import RootEntry

__all__ = ["FsspecStorage"]

T = TypeVar("T")


class _FsspecWriter:
    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self._storage = storage
        self._path = path
        self._full = storage.full(path)
        self._f: Any = storage._call("open for writing", path,
                                     lambda: storage.fs.open(self._full, "wb"))

    def write(self, data: memoryview | bytes) -> None:
        f = self._f
        self._storage._call("write", self._path, lambda: f.write(data))

    def commit(self) -> None:
        f, self._f = self._f, None
        self._storage._call("close", self._path, f.close)

    def abort(self) -> None:
        # Closing a buffered fsspec file uploads what it has: discard first, then delete whatever
        # a backend may still have committed (DESIGN.md section 10).
        f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(Exception):
                if hasattr(f, "discard"):
                    f.discard()
            with contextlib.suppress(Exception):
                f.close()
        with contextlib.suppress(Exception):
            self._storage.fs.rm(self._full)


class FsspecStorage:
    """A checkpoint root on an fsspec file system."""

    supports_rename = False

    def __init__(self, fs: Any, root: str, *, display_url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = display_url

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def full(self, path: str) -> str:
        """The backend path of relative ``path``."""
        return f"{self.root}/{path}" if path else self.root

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except StorageError:
            raise
        except Exception as e:
            where = f"{self.url}/{path}" if path else self.url
            raise StorageError(f"{what} failed for {where}: {type(e).__name__}: {e}") from e

    def _invalidate(self) -> None:
        # Listings must never come from the client's own cache (RECIPES.md).
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache()

    def scan_root(self, marker: str) -> list[RootEntry]:
        def _scan() -> list[RootEntry]:
            self._invalidate()
            if not self.fs.exists(self.root):
                return []
            # One recursive listing (paginated on object stores), not one request per step.
            found = self.fs.find(self.root, withdirs=True, detail=True)
            names: dict[str, bool] = {}
            dirs: set[str] = set()
            prefix = self.root + "/"
            for full, info in found.items():
                full = full.rstrip("/")
                if not full.startswith(prefix):
                    full = "/" + full if ("/" + full).startswith(prefix) else full
                    if not full.startswith(prefix):
                        continue
                rel = full[len(prefix):]
                parts = rel.split("/")
                top = parts[0]
                if len(parts) == 1:
                    if info.get("type") == "directory":
                        dirs.add(top)
                    names.setdefault(top, False)
                    continue
                dirs.add(top)
                names.setdefault(top, False)
                if len(parts) == 2 and parts[1] == marker and info.get("type") != "directory":
                    names[top] = True
            return [RootEntry(n, n in dirs, False, has) for n, has in sorted(names.items())]

        return self._call("list", "", _scan)

    def list_files(self, path: str) -> dict[str, int]:
        def _ls() -> dict[str, int]:
            self._invalidate()
            full = self.full(path)
            if not self.fs.exists(full):
                return {}
            out = {}
            for info in self.fs.ls(full, detail=True):
                if info.get("type") == "file":
                    out[info["name"].rstrip("/").rsplit("/", 1)[-1]] = int(info.get("size") or 0)
            return out

        return self._call("list", path, _ls)

    def exists(self, path: str) -> bool:
        self._invalidate()
        return bool(self._call("exists", path, lambda: self.fs.exists(self.full(path))))

    def size(self, path: str) -> int:
        return int(self._call("stat", path, lambda: self.fs.size(self.full(path))))

    def read_bytes(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        end = None if length is None else start + length

        def _cat() -> bytes:
            data = self.fs.cat_file(self.full(path), start=start or None, end=end)
            if length is not None and len(data) != length:
                raise EOFError(f"wanted {length} bytes at offset {start}, got {len(data)}")
            return bytes(data)

        return self._call("read", path, _cat)

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        mv = buf.cast("B")
        mv[:] = self.read_bytes(path, offset, len(mv))

    def open_writer(self, path: str) -> _FsspecWriter:
        return _FsspecWriter(self, path)

    def write_bytes(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        full = self.full(path)

        def _pipe() -> None:
            if exclusive:
                try:
                    self.fs.pipe_file(full, data, mode="create")
                except (NotImplementedError, TypeError):
                    # Backend without conditional create: check, then put.
                    self._invalidate()
                    if self.fs.exists(full):
                        raise FileExistsError(full) from None
                    self.fs.pipe_file(full, data)
            else:
                self.fs.pipe_file(full, data)

        self._call("write", path, _pipe)

    def makedirs(self, path: str) -> None:
        with contextlib.suppress(Exception):
            self.fs.makedirs(self.full(path), exist_ok=True)

    def rename(self, src: str, dst: str) -> None:
        raise StorageError(f"{self.url} has no atomic rename")

    def fsync_dir(self, path: str) -> None:
        return None

    def remove(self, path: str, *, recursive: bool = False) -> None:
        def _rm() -> None:
            full = self.full(path)
            self._invalidate()
            if not self.fs.exists(full):
                return
            self.fs.rm(full, recursive=recursive)

        self._call("remove", path, _rm)

    def is_symlink(self, path: str) -> bool:
        return False
