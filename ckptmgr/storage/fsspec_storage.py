"""Storage on any fsspec file system: memory://, gs:// (gcsfs), s3:// (s3fs) and the rest.

Object stores have no rename: a step is written in place under attempt-unique file names and the
manifest object, written last in one PUT (a conditional create where the backend has one), is the
commit.

Throughput and robustness, per operation:

- Listing the root is one recursive, paginated listing (``find``): one list request per 1000
  objects on S3 and GCS, and no request per step.
- Large writes on S3 go through our own multipart upload: parts of ``PART_SIZE`` bytes, up to
  ``UPLOAD_CONCURRENCY`` in flight, each retried on its own. Other backends stream through the
  backend's file object with a ``WRITE_BLOCK_SIZE`` buffer (gcsfs: resumable upload in chunks).
- Reads go through a sequential read-ahead: ranged reads of ``READ_BLOCK_SIZE`` bytes fetched by a
  small thread pool, up to ``READ_AHEAD_BLOCKS`` ahead of the reader, each retried on its own.
- Every request-level operation is retried on transient failures (``_retry``), bounded in attempts
  and total time, then fails with :class:`StorageError` naming the object (URL redacted) with the
  backend's exception as ``__cause__``.
- Credentials from ``storage_options``, the URL or the environment never reach a message or a log
  line (:mod:`ckptmgr._redact`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ckptmgr import _redact
from ckptmgr.errors import ConfigError, StorageError
from ckptmgr.storage import _retry
from ckptmgr.storage.base import RootEntry, redact_url

__all__ = [
    "PART_SIZE",
    "READ_AHEAD_BLOCKS",
    "READ_BLOCK_SIZE",
    "UPLOAD_CONCURRENCY",
    "WRITE_BLOCK_SIZE",
    "FsspecStorage",
    "prepare_url",
]

log = logging.getLogger("ckptmgr.storage")
T = TypeVar("T")

PART_SIZE = 16 * 2**20
"""S3 multipart part size (doubles every 1000 parts, so 10000 parts always suffice)."""
UPLOAD_CONCURRENCY = 8
"""S3 parts uploaded at once per file; memory is about (this + 1) * PART_SIZE per writer."""
WRITE_BLOCK_SIZE = 64 * 2**20
"""Buffer of the backend's file object for other backends (a multiple of GCS's 256 KiB)."""
READ_BLOCK_SIZE = 8 * 2**20
"""Size of one ranged read."""
READ_AHEAD_BLOCKS = 6
"""Ranged reads in flight ahead of a sequential reader (memory: this * READ_BLOCK_SIZE)."""
_POOL_WORKERS = 8

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _io_pool() -> ThreadPoolExecutor:
    """One small pool shared by every FsspecStorage: part uploads and ranged reads. Its tasks
    never wait on other tasks of the pool, so sharing it cannot deadlock."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_POOL_WORKERS, thread_name_prefix="ckptmgr-io")
        return _pool


def prepare_url(scheme: str, url: str, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Register the credentials of ``url`` and ``options`` for redaction; move an s3 URL's
    ``key:secret@`` into the options.

    Returns the URL to give fsspec and the options.

    Raises:
        ConfigError: credentials both in the URL and in the options, or in a gs:// URL.
    """
    opts = dict(options)
    _redact.register_options(opts)
    user, password = _redact.register_url(url)
    if user is None and password is None:
        return url, opts
    shown = redact_url(url)
    if scheme in ("s3", "s3a"):
        if "key" in opts or "secret" in opts:
            raise ConfigError(f"credentials are given both in the URL {shown!r} and in "
                              "storage_options; give them once (storage_options preferred)")
        if user:
            opts["key"] = user
        if password:
            opts["secret"] = password
        return re.sub(r"^([^:]+://)[^/@]*@", r"\1", url), opts
    if scheme in ("gs", "gcs"):
        raise ConfigError(f"gs:// URLs cannot carry credentials ({shown!r}); pass a token file "
                          "or credentials in storage_options={'token': ...}")
    return url, opts  # ftp://, sftp://, http:// ... read user:password@ themselves


def _precondition_failed(err: BaseException) -> bool:
    """Whether ``err`` says a conditional create found the object already there.

    AWS, moto and fake-gcs-server surface the 412 as FileExistsError; SeaweedFS's 412 reaches s3fs
    without the ``If-None-Match`` condition field and comes out as a plain OSError (EINVAL).
    """
    for e in _retry.exception_chain(err):
        if isinstance(e, FileExistsError):
            return True
        status, code = _retry.status_and_code(e)
        if status == 412 or code == "PreconditionFailed":
            return True
        if "precondition" in str(e).lower().replace("-", ""):
            return True
    return False


class _FileWriter:
    """Streams through the backend's own file object (gcsfs: a resumable upload)."""

    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self._storage = storage
        self._path = path
        self._full = storage.full(path)
        self._f: Any = storage._call("open for writing", path, lambda: storage.fs.open(
            self._full, "wb", block_size=WRITE_BLOCK_SIZE), retry=True)

    def write(self, data: memoryview | bytes) -> None:
        f = self._f
        # Not retried here: the buffer already moved on; the backend retries its own chunks.
        self._storage._call("write", self._path, lambda: f.write(data), retry=False)

    def writev(self, bufs: Sequence[memoryview | bytes]) -> None:
        """Append each of ``bufs`` in order (spares the caller joining them)."""
        for b in bufs:
            self.write(b)

    def commit(self) -> None:
        f, self._f = self._f, None
        self._storage._call("close", self._path, f.close, retry=False)

    def abort(self) -> None:
        # Closing a buffered fsspec file uploads what it has: discard first, then delete whatever
        # a backend may still have committed (DESIGN.md section 10).
        f, self._f = self._f, None
        if f is not None:
            discarded = False
            with contextlib.suppress(Exception):
                if hasattr(f, "discard"):
                    f.discard()
                    discarded = True
            with contextlib.suppress(Exception):
                if discarded:
                    f.closed = True  # a close() after discard would try to upload again
                else:
                    f.close()
        with contextlib.suppress(Exception):
            self._storage.fs.rm(self._full)


class _S3MultipartWriter:
    """Our own S3 multipart upload: parts uploaded in parallel, each retried on its own.

    Invariant: the object appears only at ``complete_multipart_upload`` (or the single PUT of a
    small file) in ``commit``; a failure or ``abort`` before that leaves no object, and the upload
    is aborted so no parts linger (a killed process leaves an incomplete upload: see
    docs/storage.md for the bucket lifecycle rule that removes those).
    """

    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self._storage = storage
        self._path = path
        self._full = storage.full(path)
        self._bucket, self._key = storage.fs.split_path(self._full)[:2]
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._futures: list[Future[dict[str, Any]]] = []
        self._slots = threading.BoundedSemaphore(UPLOAD_CONCURRENCY)
        self._size = 0
        self._done = False

    def _part_size(self) -> int:
        return PART_SIZE << (len(self._futures) // 1000)

    def _s3(self, what: str, method: str, **kwargs: Any) -> Any:
        fs = self._storage.fs
        return self._storage._call(what, self._path, lambda: fs.call_s3(
            method, Bucket=self._bucket, Key=self._key, **kwargs))

    def write(self, data: memoryview | bytes) -> None:
        if self._done:
            raise StorageError(f"write after commit/abort of {self._storage.where(self._path)}")
        mv = memoryview(data).cast("B")
        pos = 0
        while pos < len(mv):
            take = min(self._part_size() - len(self._buf), len(mv) - pos)
            self._buf += mv[pos:pos + take]
            pos += take
            if len(self._buf) >= self._part_size():
                self._send_part()
        self._size += len(mv)

    def writev(self, bufs: Sequence[memoryview | bytes]) -> None:
        """Append each of ``bufs`` in order (spares the caller joining them)."""
        for b in bufs:
            self.write(b)

    def _raise_failed(self) -> None:
        for fut in self._futures:
            if fut.done() and fut.exception() is not None:
                fut.result()

    def _send_part(self) -> None:
        if self._upload_id is None:
            self._upload_id = self._s3("start upload", "create_multipart_upload")["UploadId"]
        part, self._buf = bytes(self._buf), bytearray()
        number = len(self._futures) + 1
        self._slots.acquire()  # bounds memory: at most UPLOAD_CONCURRENCY parts in flight
        try:
            self._raise_failed()
            fut = _io_pool().submit(_retry.in_budget(self._upload_part), number, part)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _: self._slots.release())
        self._futures.append(fut)

    def _upload_part(self, number: int, part: bytes) -> dict[str, Any]:
        out = self._s3(f"upload part {number}", "upload_part", PartNumber=number,
                       UploadId=self._upload_id, Body=part)
        return {"PartNumber": number, "ETag": out["ETag"]}

    def commit(self) -> None:
        if self._done:
            raise StorageError(f"commit after commit/abort of {self._storage.where(self._path)}")
        self._done = True
        try:
            if self._upload_id is None:
                data = bytes(self._buf)
                self._buf = bytearray()
                fs = self._storage.fs
                self._storage._call("write", self._path, lambda: fs.pipe_file(self._full, data))
                return
            if self._buf or not self._futures:
                self._send_part()
            parts = [f.result() for f in self._futures]
            self._complete(parts)
        except BaseException:
            self._abort_upload()
            raise
        finally:
            self._storage._invalidate()

    def _complete(self, parts: list[dict[str, Any]]) -> None:
        try:
            self._s3("complete upload", "complete_multipart_upload", UploadId=self._upload_id,
                     MultipartUpload={"Parts": parts})
        except StorageError:
            # A retried completion whose first try landed answers NoSuchUpload: the object is
            # there with our size, so the upload did complete.
            with contextlib.suppress(Exception):
                self._storage._invalidate()
                if int(self._storage.fs.info(self._full)["size"]) == self._size:
                    self._upload_id = None
                    return
            raise
        self._upload_id = None

    def _abort_upload(self) -> None:
        for fut in self._futures:
            fut.cancel()
        for fut in self._futures:
            with contextlib.suppress(BaseException):
                fut.result()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            with contextlib.suppress(Exception):
                self._storage.fs.call_s3("abort_multipart_upload", Bucket=self._bucket,
                                         Key=self._key, UploadId=upload_id)

    def abort(self) -> None:
        self._done = True
        self._buf = bytearray()
        self._abort_upload()
        with contextlib.suppress(Exception):
            self._storage.fs.rm(self._full)


class _ReadAhead:
    """Sequential read-ahead over one object.

    Blocks of READ_BLOCK_SIZE bytes are fetched by ranged reads in the shared pool; a reader that
    keeps reading forward gets up to READ_AHEAD_BLOCKS blocks fetched ahead of it (the window
    starts at 2 and doubles per sequential read; a jump resets it), so a restore that reads a file
    item by item moves at the speed of parallel ranged reads. Memory is bounded by the window.
    """

    def __init__(self, storage: FsspecStorage, path: str, size: int) -> None:
        self.storage = storage
        self.path = path
        self.size = size
        self.blocks: dict[int, Future[bytes]] = {}
        self.ahead = 2
        self.lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        return -(-self.size // READ_BLOCK_SIZE)

    def _fetch(self, index: int) -> bytes:
        start = index * READ_BLOCK_SIZE
        end = min(self.size, start + READ_BLOCK_SIZE)
        return self.storage._read_range(self.path, start, end)

    def _ensure(self, first: int, last: int) -> None:
        for b in range(first, min(last, self.num_blocks - 1) + 1):
            if b not in self.blocks:
                self.blocks[b] = _io_pool().submit(_retry.in_budget(self._fetch), b)

    def drop(self) -> None:
        for fut in self.blocks.values():
            fut.cancel()
        self.blocks.clear()

    def read_into(self, offset: int, mv: memoryview) -> None:
        n = len(mv)
        if n == 0:
            return
        if offset < 0 or offset + n > self.size:
            raise StorageError(
                f"read failed for {self.storage.where(self.path)}: wanted bytes "
                f"[{offset}, {offset + n}) of a {self.size}-byte object (truncated?)")
        first = offset // READ_BLOCK_SIZE
        last = (offset + n - 1) // READ_BLOCK_SIZE
        with self.lock:
            sequential = first in self.blocks
            for b in [b for b in self.blocks if b < first]:
                self.blocks.pop(b).cancel()
            if not sequential:
                self.drop()
                self.ahead = 2
            try:
                pos = 0
                for b in range(first, last + 1):
                    self._ensure(b, b + self.ahead)
                    data = self.blocks[b].result()
                    lo = offset + pos - b * READ_BLOCK_SIZE
                    take = min(len(data) - lo, n - pos)
                    mv[pos:pos + take] = data[lo:lo + take]
                    pos += take
                    if b < last:
                        del self.blocks[b]
                nxt = last
                if (offset + n) % READ_BLOCK_SIZE == 0:
                    self.blocks.pop(last, None)
                    nxt = last + 1
                self.ahead = min(READ_AHEAD_BLOCKS, self.ahead * 2)
                self._ensure(nxt, nxt + self.ahead - 1)
            except BaseException:
                self.drop()
                raise


class _FsspecReader:
    """Vectored reads of one object through a :class:`_ReadAhead` (made at the first read)."""

    def __init__(self, storage: FsspecStorage, path: str) -> None:
        self._storage = storage
        self._path = path
        self._stream: _ReadAhead | None = None

    def readv_into(self, offset: int, bufs: Sequence[memoryview]) -> None:
        """Fill ``bufs`` in order with the bytes of the object from ``offset`` on."""
        if self._stream is None:
            self._stream = _ReadAhead(self._storage, self._path,
                                      self._storage._object_size(self._path))
        for b in bufs:
            mv = b.cast("B") if b.format != "B" or b.ndim != 1 else b
            self._stream.read_into(offset, mv)
            offset += len(mv)

    def close(self) -> None:
        """Drop the blocks read ahead; never raises."""
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.drop()

    def __enter__(self) -> _FsspecReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FsspecStorage:
    """A checkpoint root on an fsspec file system.

    Args:
        fs: the fsspec file system.
        root: the root path on ``fs`` (no protocol).
        display_url: the root URL with credentials redacted, for messages.
        retry: retry bounds (None: ``_retry.DEFAULT_POLICY`` at call time).
    """

    # Capabilities: RangeReads (open_reader); its writers are VectoredWriters. No AtomicRename:
    # object stores have no rename. ``supports_rename`` (and ``fsync_dir``) only keep older
    # callers working until they check ``isinstance(storage, AtomicRename)``.
    supports_rename = False

    def __init__(self, fs: Any, root: str, *, display_url: str,
                 retry: _retry.RetryPolicy | None = None) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        # What the backend was built with, fsspec's config and environment included.
        _redact.register_options(getattr(fs, "storage_options", None) or {})
        self.url = _redact.redact(display_url)
        self.retry = retry
        self._sizes: dict[str, int] = {}
        self._multipart = callable(getattr(fs, "call_s3", None)) and callable(
            getattr(fs, "split_path", None))
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self._bucket_store = bool({"s3", "s3a", "gs", "gcs"} & set(protocols))

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def full(self, path: str) -> str:
        """The backend path of relative ``path``."""
        return f"{self.root}/{path}" if path else self.root

    def where(self, path: str) -> str:
        """The redacted URL of relative ``path``, for messages."""
        return f"{self.url}/{path}" if path else self.url

    def _call(self, what: str, path: str, fn: Callable[[], T], *, retry: bool = True) -> T:
        where = self.where(path)
        try:
            if retry:
                return _retry.call_with_retries(fn, what=f"{what} {where}", policy=self.retry)
            return fn()
        except StorageError:
            raise
        except Exception as e:
            hint = ""
            if any(type(c).__name__ == "NoCredentialsError" for c in _retry.exception_chain(e)):
                hint = ("; S3 credentials come from storage_options={'key': ..., 'secret': ...}, "
                        "the AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) environment "
                        "variables, ~/.aws/credentials, or an instance or pod role")
            raise StorageError(_redact.redact(
                f"{what} failed for {where}: {type(e).__name__}: {e}{hint}")) from e

    def _invalidate(self) -> None:
        # Listings must never come from the client's own cache (RECIPES.md).
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache()

    def scan_root(self, marker: str) -> list[RootEntry]:
        def _scan() -> list[RootEntry]:
            self._invalidate()
            # One recursive listing (paginated on object stores), not one request per step;
            # an absent root lists as empty.
            try:
                found = self.fs.find(self.root, withdirs=True, detail=True)
            except FileNotFoundError:
                return []
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

    def list_dirs(self, path: str) -> list[str]:
        def _ls() -> list[str]:
            self._invalidate()
            try:
                infos = self.fs.ls(self.full(path), detail=True)
            except FileNotFoundError:
                return []
            return sorted(i["name"].rstrip("/").rsplit("/", 1)[-1] for i in infos
                          if i.get("type") != "file")

        return self._call("list", path, _ls)

    def list_files(self, path: str) -> dict[str, int]:
        def _ls() -> dict[str, int]:
            self._invalidate()
            full = self.full(path)
            try:
                infos = self.fs.ls(full, detail=True)
            except FileNotFoundError:
                return {}
            out = {}
            for info in infos:
                if info.get("type") == "file":
                    name = info["name"].rstrip("/")
                    size = int(info.get("size") or 0)
                    out[name.rsplit("/", 1)[-1]] = size
                    self._sizes[f"{full}/{name.rsplit('/', 1)[-1]}"] = size
            return out

        return self._call("list", path, _ls)

    def exists(self, path: str) -> bool:
        full = self.full(path)

        def _exists() -> bool:
            self._invalidate()
            if self.fs.isfile(full):
                return True
            # A prefix exists while objects are under it. Not fs.exists(): SeaweedFS keeps an
            # emptied prefix listed as a directory for minutes after its last object is gone.
            try:
                found = self.fs.find(full, detail=True)
            except FileNotFoundError:
                return False
            return any(info.get("type") != "directory" for info in found.values())

        return self._call("exists", path, _exists)

    def size(self, path: str) -> int:
        def _size() -> int:
            # Never from a cached listing: another process (a writer process, another job) may
            # have written the object since this client listed its directory.
            self._invalidate()
            return int(self.fs.size(self.full(path)))

        return self._call("stat", path, _size)

    def _read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``path`` in one ranged read (retried)."""

        def _cat() -> bytes:
            data = self.fs.cat_file(self.full(path), start=start, end=end)
            if len(data) != end - start:
                raise EOFError(f"wanted {end - start} bytes at offset {start}, got {len(data)}")
            return bytes(data)

        return self._call("read", path, _cat)

    def read_bytes(self, path: str, start: int = 0, length: int | None = None) -> bytes:
        if length is not None:
            return self._read_range(path, start, start + length) if length else b""

        def _cat() -> bytes:
            return bytes(self.fs.cat_file(self.full(path), start=start or None))

        return self._call("read", path, _cat)

    def _object_size(self, path: str) -> int:
        full = self.full(path)
        size = self._sizes.get(full)
        if size is None:
            size = self.size(path)
            self._sizes[full] = size
        return size

    def read_into(self, path: str, offset: int, buf: memoryview) -> None:
        mv = buf.cast("B")
        if len(mv) < 2 * READ_BLOCK_SIZE:
            mv[:] = self._read_range(path, offset, offset + len(mv))
            return
        # Large: ranged reads in parallel, straight into the buffer.
        with self.open_reader(path) as reader:
            reader.readv_into(offset, [mv])

    def open_reader(self, path: str) -> _FsspecReader:
        """A reader of ``path`` for vectored, mostly sequential reads with read-ahead (the DCP
        reader uses it when a storage has one); close it to release its buffers."""
        return _FsspecReader(self, path)

    def open_writer(self, path: str,
                    size_hint: int | None = None) -> _FileWriter | _S3MultipartWriter:
        # size_hint is not needed: parts and chunks are sized per write.
        self._sizes.pop(self.full(path), None)
        if self._multipart:
            return _S3MultipartWriter(self, path)
        return _FileWriter(self, path)

    def write_bytes(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        full = self.full(path)
        self._sizes.pop(full, None)

        def _put() -> None:
            if not exclusive:
                self.fs.pipe_file(full, data)
                return
            try:
                self.fs.pipe_file(full, data, mode="create")
            except (NotImplementedError, TypeError):
                # A backend without conditional create: check, then put (racy; documented).
                self._invalidate()
                if self.fs.exists(full):
                    raise FileExistsError(full) from None
                self.fs.pipe_file(full, data)
            except Exception as e:
                if not _precondition_failed(e):
                    raise
                if self._same_content(full, data):
                    # Our own earlier try landed and its answer was lost (a retry by us or by
                    # the client library met "exists"): byte-equal content means it is ours,
                    # since every manifest names its random attempt id.
                    return
                raise FileExistsError(f"{self.where(path)} already exists") from e

        self._call("write", path, _put)

    def _same_content(self, full: str, data: bytes) -> bool:
        try:
            return bool(self.fs.cat_file(full) == data)
        except Exception:
            return False

    def makedirs(self, path: str) -> None:
        if self._bucket_store:
            return  # no directories on object stores; s3fs and gcsfs would create a bucket
        with contextlib.suppress(Exception):
            self.fs.makedirs(self.full(path), exist_ok=True)

    def check_bucket(self) -> None:
        """Raise ConfigError when the bucket of an s3:// or gs:// root does not exist (never
        creates one); StorageError when the store cannot be reached or asked. Other file
        systems: nothing to check."""
        if not self._bucket_store:
            return
        bucket = self.root.split("/", 1)[0]
        # s3fs: head_bucket says 404, where exists() says False on any error (even unreachable).
        if self._multipart:
            def _head() -> bool:
                try:
                    self.fs.call_s3("head_bucket", Bucket=bucket)
                except Exception as e:
                    status, code = _retry.status_and_code(e)
                    if isinstance(e, FileNotFoundError) or status == 404 or code in (
                            "404", "NoSuchBucket"):
                        return False
                    raise
                return True
        else:  # gcsfs
            def _head() -> bool:
                try:
                    self.fs.call("GET", "b/{}", bucket, json_out=True)
                except FileNotFoundError:
                    return False
                return True
        # Not retried on top of the client's own retries: this call is the constructor's budget.
        if not self._call("checking the bucket", "", _head, retry=False):
            raise ConfigError(f"bucket {bucket!r} of {self.url!r} does not exist; create it "
                              "first (ckptmgr never creates buckets)")

    def fsync_dir(self, path: str) -> None:
        """No-op, kept only for callers written before :class:`AtomicRename` (which object stores
        do not have; ``fsync_dir`` belongs to it): remove once none calls it."""
        return None

    def remove(self, path: str, *, recursive: bool = False) -> None:
        full = self.full(path)
        self._sizes.pop(full, None)

        def _rm() -> None:
            self._invalidate()
            try:
                self.fs.rm(full, recursive=recursive)
            except FileNotFoundError:
                return  # absent is not an error
            if recursive:
                for k in [k for k in self._sizes if k.startswith(full + "/")]:
                    self._sizes.pop(k, None)

        self._call("remove", path, _rm)

    def is_symlink(self, path: str) -> bool:
        return False
