"""Our DCP ``StorageReader``: reads straight into destination tensors and verifies every item.

Call order (DCP's, per restore):
1) (all ranks) ``reset`` (DCP's ``checkpoint_id``: the standalone reader's URL);
   ``read_metadata``: the standalone reader (``CkptStorageReader(url)``) reads the manifest
   (size-bounded, validated), then the JSON metadata it lists (size and checksum checked; never
   pickle); a manager's reader (:meth:`CkptStorageReader.for_step`) returns what the manager read
   and validated already; ``set_up_storage_reader``, ``prepare_local_plan``
2) (coordinator) ``prepare_global_plan``
3) (all ranks) ``read_data``: check the size of every file the plan touches before reading any
   bytes; decode Python values from tagged JSON (pickle only when ``trusted``); then, on the
   calling thread, resolve every tensor item's destination: the tensor itself when it is a whole
   contiguous CPU tensor of the stored dtype, else a buffer that is narrowed and copied afterwards.
   The reads, sorted by file and offset, are cut into ``num_threads`` runs of about equal bytes;
   each run's thread has a storage that streams (``StreamReads``: large reads of local files not
   in the page cache, read ahead with direct I/O) fill the destinations and checksums each item
   as it completes, or else reads adjacent items with one ``preadv`` per 4 MiB (scattering into
   the destinations) and checksums each piece while it is in cache. Destinations are committed
   to the planner on the calling thread, in order, once every read of a window succeeded. Buffered
   destinations (a CUDA tensor, another dtype, a part of a stored chunk) are staged in windows of
   at most 256 MiB, carved from two reused host buffers: while one window's chunks are copied
   into their destinations on the calling thread, the next window is read (one reader thread), so
   the copies to a GPU overlap the disk; at most 512 MiB of staging is held at once (or one chunk
   larger than a window, and the window beside it only when the two fit in 512 MiB).
   Python values go to our load planners decoded (``load_value``); any other planner (DCP's
   ``DefaultLoadPlanner``) gets them as bytes it can load (``load_bytes``): ``torch.save`` of the
   decoded JSON value, or the stored pickle bytes when ``trusted``.
"""

from __future__ import annotations

import contextvars
import io
import os
import sys
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future as _Pending
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptmgr._threads import finish_surely
from ckptmgr.codec.checksum import Hasher, checksum
from ckptmgr.codec.layout import is_shared_chunk_path, join
from ckptmgr.codec.manifest import Manifest
from ckptmgr.codec.metadata import ItemLocation
from ckptmgr.codec.values import MAX_VALUE_BYTES, decode_value
from ckptmgr.config import check_flag
from ckptmgr.dcp._args import check_options, check_url
from ckptmgr.dcp._streams import Stopped, run_streams, split_runs
from ckptmgr.dcp.metadata import find_chunk, metadata_from_doc
from ckptmgr.dcp.planner import CkptLoadPlanner
from ckptmgr.dcp.tensor_bytes import tensor_memoryview
from ckptmgr.errors import (
    ConfigError,
    CorruptCheckpointError,
    RestoreError,
    UnsafeCheckpointError,
)
from ckptmgr.step_store import StepStore
from ckptmgr.storage import (
    RangeReads,
    Storage,
    StreamReads,
    is_url_supported,
    open_storage,
    redact_url,
)

__all__ = ["DEFAULT_NUM_THREADS", "CkptStorageReader"]

DEFAULT_NUM_THREADS = 1
"""Read streams per rank when the caller does not choose. One: in 7 interleaved cold restores of
1 GiB here it took 0.74 s (median; 0.83x the read floor) at 0.43 s of CPU, two streams 1.28 s at
0.87 s of CPU (docs/performance.md); the kernel's readahead keeps the disk busy while it hashes."""
# Bytes per vectored read. 4 MiB: a cold restore of 1 GiB (816 tensors, one stream, files without
# padding) took 0.75x the time of 16 MiB reads (median of 10 interleaved pairs, quiet machine):
# smaller reads return sooner to be hashed while the kernel's readahead (8 MiB here) keeps the
# disk busy. 16 MiB was chosen with two streams, when direct-written files had padding before
# each large item and reads were one item (~2.5 MiB) long anyway (docs/performance.md).
_BATCH = 4 << 20
_BATCH_ITEMS = 256
_MIN_STREAM_BYTES = 64 << 20
_MAX_BUFFERED = 512 << 20  # bytes of staging buffers held at once for non-direct destinations
# Staged bytes per window: two windows (one being read, one being copied out) fit _MAX_BUFFERED.
_WINDOW = _MAX_BUFFERED // 2
# Each staged chunk starts on a cache line, which is a multiple of every dtype's element size.
_ALIGN = 64
PIPELINE = True
"""Read the next window while the calling thread copies the last one out (module docstring);
False: one window at a time (an experiment's knob for ``benchmarks/``, not a user setting)."""
_UNPLACED = torch.empty(0, dtype=torch.uint8)  # a staged read's destination before its window


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class _TensorRead:
    """One stored chunk and where its bytes go."""

    idx: MetadataIndex
    loc: ItemLocation
    items: list[ReadItem]
    dest: torch.Tensor  # the destination itself (direct) or a staging buffer of the chunk
    direct: bool
    shape: tuple[int, ...] = ()  # the stored chunk's (a staged read's buffer is carved to it)
    dtype: torch.dtype = torch.uint8
    ok: bool = True
    hasher: Hasher | None = field(default=None, repr=False)


class _Staging:
    """Reused host buffers that staged reads are carved from, one buffer per window: a restore's
    windows take turns in (at most) two buffers instead of allocating, and page-faulting, fresh
    memory for every chunk. A window larger than :data:`_WINDOW` (one big chunk) gets a buffer
    of its own size."""

    def __init__(self, reuse: bool) -> None:
        """``reuse``: buffers of at least a window, taken again by later windows; else each
        window's buffer is just its size (a restore of one window)."""
        self._reuse = reuse
        self._free: list[torch.Tensor] = []

    def size(self, window: Sequence[_TensorRead]) -> int:
        """Bytes of the buffer ``window`` takes (0: all of its reads land in place)."""
        if all(r.direct for r in window):
            return 0
        need = sum(_aligned(r.loc.length) for r in window if not r.direct)
        return max(_WINDOW, need) if self._reuse else need

    def place(self, window: Sequence[_TensorRead]) -> torch.Tensor | None:
        """Give each staged read of ``window`` its buffer; returns the window's (None: all of
        its reads land in place)."""
        size = self.size(window)
        if size == 0:
            return None
        fits = [i for i, b in enumerate(self._free) if b.numel() >= size]
        if fits:
            buf = self._free.pop(fits[0])
        else:
            if size > _WINDOW:
                self._free.clear()  # one chunk over a window: held alone, as it was read alone
            buf = torch.empty(size, dtype=torch.uint8)
        pos = 0
        for r in window:
            if not r.direct:
                r.dest = _carve(buf, pos, r.shape, r.dtype)
                pos += _aligned(r.loc.length)
        return buf

    def release(self, window: Sequence[_TensorRead], buf: torch.Tensor | None) -> None:
        """``window`` was copied out: its buffer takes the next window's reads."""
        for r in window:
            if not r.direct:
                r.dest = _UNPLACED
        if self._reuse and buf is not None and buf.numel() <= _WINDOW:  # larger: not kept
            self._free.append(buf)


def _carve(buf: torch.Tensor, pos: int, shape: tuple[int, ...], dtype: torch.dtype
           ) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` on bytes ``[pos, ...)`` of uint8 ``buf``; a tensor of
    its own where the dtype cannot view bytes (a dtype torch does not view as bytes)."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    try:
        return buf[pos:pos + nbytes].view(dtype).view(shape)
    except RuntimeError:
        return torch.empty(shape, dtype=dtype)


class _RangeReader:
    """Vectored range reads of one file: the storage's own reader when it has
    :class:`RangeReads`, else ranged reads of the whole span scattered into the buffers (one
    request per span on object stores)."""

    def __init__(self, storage: Storage, path: str) -> None:
        self._storage = storage
        self._path = path
        self._native = storage.open_reader(path) if isinstance(storage, RangeReads) else None

    def readv_into(self, offset: int, bufs: Sequence[memoryview]) -> None:
        if self._native is not None:
            self._native.readv_into(offset, bufs)
        elif len(bufs) == 1:
            self._storage.read_into(self._path, offset, bufs[0])
        else:
            data = memoryview(self._storage.read_bytes(self._path, offset,
                                                       sum(len(b) for b in bufs)))
            pos = 0
            for b in bufs:
                b[:] = data[pos:pos + len(b)]
                pos += len(b)

    def close(self) -> None:
        if self._native is not None:
            self._native.close()


class CkptStorageReader(StorageReader):
    """DCP's ``StorageReader`` for checkpoints in ckptmgr's byte format: reads straight into
    the destination tensors, verifies every checksum, and never unpickles unless ``trusted``.

    Two ways to make one:

    - ``CkptStorageReader(url)``: a standalone reader for plain ``torch.distributed.checkpoint``
      (``dcp.load(state_dict, storage_reader=CkptStorageReader(url))``, any planner, any number
      of ranks, resharding; DCP's ``checkpoint_id`` argument sets or changes the URL). ``url``
      is one checkpoint's directory: what ``CkptStorageWriter(url)`` wrote, or a committed step
      of a ckptmgr root (``<root>/<step>``).
    - :meth:`for_step`: one committed step whose manifest and metadata the manager read and
      validated already.
    """

    listed: dict[str, int] | None = None
    """The step directory's file sizes as the coordinator listed them for every rank (set by the
    caller); None: this rank lists the step itself before reading."""

    storage: Storage
    manifest: Manifest
    metadata: Metadata

    def __init__(self, url: str | os.PathLike[str] | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 trusted: bool = False) -> None:
        """
        Args:
            url: the checkpoint directory; None: set by DCP's ``checkpoint_id`` (``reset``).
            storage_options: fsspec options for ``url`` (endpoint, credentials, ...).
            trusted: load values that were stored with pickle (which runs code from the
                checkpoint: only for checkpoints you trust).

        Raises:
            ConfigError: a bad argument, or a URL :func:`~ckptmgr.storage.open_storage` refuses.
            BackendNotInstalledError: the URL's fsspec backend is not installed.
        """
        super().__init__()
        self.trusted = check_flag("trusted", trusted)
        self._url = check_url(url, "url")
        self._options = check_options(storage_options, "storage_options")
        self._standalone = True
        self._loaded = False
        self.step_dir = ""
        self.verify = True
        self.num_threads = DEFAULT_NUM_THREADS
        self.bytes_read = 0
        if self._url is not None:
            self.storage = open_storage(self._url, self._options, writable=False)

    @classmethod
    def for_step(cls, storage: Storage, step_dir: str, manifest: Manifest, metadata: Metadata,
                 *, verify: bool = True, trusted: bool = False,
                 num_threads: int | None = None) -> CkptStorageReader:
        """A reader of one committed step the caller read and validated already (the manager).

        Args:
            storage: where the step is.
            step_dir: the step's directory under the storage root.
            manifest: the step's manifest (already read and checked).
            metadata: the step's metadata (already read and checked).
            verify: check every item's checksum.
            trusted: allow values stored with pickle.
            num_threads: read streams per rank; None: :data:`DEFAULT_NUM_THREADS`.
        """
        reader = cls(trusted=trusted)
        reader._standalone = False
        reader._loaded = True
        reader.num_threads = max(1, num_threads or DEFAULT_NUM_THREADS)
        reader.storage = storage
        reader.step_dir = step_dir
        reader.manifest = manifest
        reader.metadata = metadata
        reader.verify = verify
        return reader

    @property
    def url(self) -> str | None:
        """The checkpoint directory's URL, credentials redacted (None until one is set)."""
        if self._url is not None:
            return redact_url(self._url)
        storage = self.__dict__.get("storage")
        return None if storage is None else f"{storage.url}/{self.step_dir}".rstrip("/")

    def __repr__(self) -> str:
        return f"CkptStorageReader({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_shared", None)
        if self._standalone:
            state.pop("storage", None)  # opened again where it is unpickled, and read again
            state["_loaded"] = False
        return state

    def _storage(self) -> Storage:
        storage: Storage | None = self.__dict__.get("storage")
        if storage is None:
            if self._url is None:
                raise ConfigError(
                    "CkptStorageReader has no URL: pass one (CkptStorageReader(url)) or give "
                    "dcp.load a checkpoint_id")
            storage = self.storage = open_storage(self._url, self._options, writable=False)
        return storage

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """(all ranks) A new load begins; ``checkpoint_id`` (DCP's argument) replaces the URL.

        Raises:
            ConfigError: a bad ``checkpoint_id``, or one given to a :meth:`for_step` reader.
        """
        self.bytes_read = 0
        if checkpoint_id is not None:
            if not self._standalone:
                raise ConfigError("a CkptStorageReader made by for_step reads its own step; it "
                                  "takes no checkpoint_id")
            url = check_url(checkpoint_id, "checkpoint_id")
            if url != self._url:
                self._url = url
                self.__dict__.pop("storage", None)
                self.__dict__.pop("_shared", None)
            self._storage()
        if self._standalone:
            self._loaded = False

    # DCP falls back to per-rank metadata, read_metadata(rank=...), when a reader's signature has
    # a parameter named "kwargs" and the first read failed: ours has none, so its error stands.
    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        """(all ranks) The checkpoint's DCP metadata.

        Standalone: the manifest is read (size-bounded, validated), then the JSON metadata it
        names (size and checksum checked against the manifest); on every call, since DCP calls
        it once per load and a reader may be used for several (the directory may have been
        saved to again in between).

        Raises:
            CheckpointNotFoundError: no committed checkpoint at the URL (the message says what is
                there instead: a plain-DCP checkpoint, a ckptmgr root, nothing).
            CorruptCheckpointError, UnsafeCheckpointError: a damaged or unsafe manifest or
                metadata.
            RestoreError: a checkpoint written on a host of the other byte order.
        """
        if not self._standalone:
            return self.metadata
        store = StepStore(self._storage())
        manifest, _ = store.read_dir_manifest("")
        if manifest.byteorder != sys.byteorder:
            raise RestoreError(f"{self.url} was written on a {manifest.byteorder}-endian host; "
                               f"this host is {sys.byteorder}-endian", step=manifest.step)
        self.metadata = metadata_from_doc(store.read_metadata("", manifest, verify=self.verify),
                                          manifest)
        self.manifest = manifest
        self._loaded = True
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a path or URL this reader can open (no I/O)."""
        return is_url_supported(checkpoint_id)

    def _corrupt(self, msg: str, path: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"step {self.manifest.step}: {path}: {msg}; the checkpoint is damaged, restore another "
            "step", step=self.manifest.step, path=path)

    def _location(self, index: MetadataIndex) -> ItemLocation:
        # Never ``storage_data or {}``: the truth test of format-2 metadata's lazy mapping
        # counts every chunk, which made a restore quadratic in the number of tensors.
        locations = self.metadata.storage_data
        loc = None if locations is None else locations.get(index)
        if loc is None:
            raise self._corrupt(f"no stored bytes for {index.fqn!r} at {index.offset}",
                                self.manifest.metadata_file)
        return loc  # type: ignore[no-any-return]

    def _shared_storage(self) -> Storage:
        """Where the shared chunks (``chunks/<hex>``, root-relative) of this step are: the
        manager's root; for a standalone reader of ``<root>/<step>``, that URL's parent."""
        if not self._standalone:
            return self.storage
        shared: Storage | None = self.__dict__.get("_shared")
        if shared is None:
            url = (self._url or "").rstrip("/")
            parent, sep, _ = url.rpartition("/")
            if not sep or not parent or parent.endswith(":/") or parent.endswith(":"):
                raise CorruptCheckpointError(
                    f"{self.url} references shared chunks of its root (saved with "
                    "reuse_unchanged=True) but has no parent directory to find them in; read it "
                    "as <root>/<step>, or copy it to stand alone with `ckptmgr cp`",
                    step=self.manifest.step)
            shared = self._shared = open_storage(parent, self._options, writable=False)
        return shared

    def _locate(self, file: str) -> tuple[Storage, str]:
        """The storage and path of a file the metadata names: a shared chunk is root-relative,
        anything else is in the step directory."""
        if is_shared_chunk_path(file):
            return self._shared_storage(), file
        return self.storage, join(self.step_dir, file)

    def _check_sizes(self, files: set[str]) -> None:
        listed = self.listed
        if listed is None:
            listed = self.storage.list_files(self.step_dir)
            if any(is_shared_chunk_path(f) for f in files):
                listed.update(StepStore(self._shared_storage()).shared_sizes())
        for f in sorted(files):
            try:
                entry = self.manifest.file(f)
            except KeyError:
                raise self._corrupt("not listed in the manifest", f) from None
            actual = listed.get(f)
            if actual is None:
                raise self._corrupt("file is missing", f)
            if actual != entry.size:
                raise self._corrupt(f"size is {actual} bytes, the manifest says {entry.size} "
                                    "(truncated or overwritten)", f)

    def _verify(self, loc: ItemLocation, data: memoryview | bytes, fqn: str) -> None:
        if self.verify and checksum(data) != loc.checksum:
            raise self._corrupt(f"checksum mismatch in the bytes of {fqn!r}", loc.file)

    def _read(self, loc: ItemLocation, buf: memoryview) -> None:
        storage, path = self._locate(loc.file)
        storage.read_into(path, loc.offset, buf)
        self.bytes_read += len(buf)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """(all ranks) Read this rank's items (module docstring)."""
        if not self._loaded:
            self.read_metadata()
        groups: dict[MetadataIndex, list[ReadItem]] = defaultdict(list)
        for ri in plan.items:
            groups[ri.storage_index].append(ri)
        located = {idx: self._location(idx) for idx in groups}
        self._check_sizes({loc.file for loc in located.values()})
        for idx, loc in located.items():
            # Checked before allocating a buffer of loc.length bytes or reading anything: a
            # value's claim is bounded, and every claim must lie within the bytes the file has
            # in storage (its listed size matched the manifest above).
            if groups[idx][0].type == LoadItemType.BYTE_IO and loc.length > MAX_VALUE_BYTES:
                raise self._corrupt(
                    f"value {idx.fqn!r} claims {loc.length} bytes, more than the "
                    f"{MAX_VALUE_BYTES} a stored Python value may take", loc.file)
            size = self.manifest.file(loc.file).size
            if loc.offset + loc.length > size:
                raise self._corrupt(
                    f"bytes [{loc.offset}, {loc.offset + loc.length}) of {idx.fqn!r} lie beyond "
                    f"the end of the file ({size} bytes)", loc.file)
        order = sorted(groups, key=lambda i: (located[i].file, located[i].offset))
        windows: list[list[_TensorRead]] = [[]]
        buffered = 0
        for idx in order:
            loc, items = located[idx], groups[idx]
            if items[0].type == LoadItemType.BYTE_IO:
                self._read_value(loc, items, planner)
                continue
            read = self._plan_tensor(idx, loc, items, planner)
            if not read.direct:
                if buffered + _aligned(loc.length) > _WINDOW and windows[-1]:
                    windows.append([])
                    buffered = 0
                buffered += _aligned(loc.length)
            windows[-1].append(read)
        if windows[-1]:
            self._run_windows(windows, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _plan_tensor(self, idx: MetadataIndex, loc: ItemLocation, items: list[ReadItem],
                     planner: LoadPlanner) -> _TensorRead:
        """(calling thread) Check the stored chunk and choose its destination."""
        fqn = idx.fqn
        md = self.metadata.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise self._corrupt(f"{fqn!r} is not a tensor in the metadata", loc.file)
        offsets = tuple(idx.offset) if idx.offset is not None else (0,) * len(md.size)
        chunk = find_chunk(md.chunks, offsets, idx.index)
        if chunk is None:
            raise self._corrupt(f"no chunk of {fqn!r} at offsets {list(offsets)}", loc.file)
        dtype = md.properties.dtype
        numel = 1
        for s in chunk.sizes:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes != loc.length:
            raise self._corrupt(f"{fqn!r} needs {nbytes} bytes, the metadata says {loc.length}",
                                loc.file)
        if len(items) == 1 and list(items[0].storage_offsets) == [0] * len(chunk.sizes) and (
                list(items[0].lengths) == list(chunk.sizes)):
            target = planner.resolve_tensor(items[0]).detach()
            if (target.device.type == "cpu" and target.dtype == dtype
                    and target.is_contiguous() and target.numel() == numel):
                return _TensorRead(idx, loc, items, target, direct=True)
        return _TensorRead(idx, loc, items, _UNPLACED, direct=False,
                           shape=tuple(chunk.sizes), dtype=dtype)

    def _run_windows(self, windows: list[list[_TensorRead]], planner: LoadPlanner) -> None:
        """Read and commit ``windows`` in order; with :data:`PIPELINE` the next window is read on
        a reader thread while the calling thread commits the last one. Every read has ended
        before this returns or raises (no thread is left writing into a tensor)."""
        staging = _Staging(reuse=len(windows) > 1)
        if len(windows) == 1 or not PIPELINE:
            for w in windows:
                buf = staging.place(w)
                self._fetch_window(w)
                self._commit_window(w, planner)
                staging.release(w, buf)
            return
        pending: dict[int, tuple[_Pending[None], torch.Tensor | None]] = {}
        stop = threading.Event()
        reader = ThreadPoolExecutor(1, thread_name_prefix="ckptmgr-restore")

        def start(i: int) -> None:
            buf = staging.place(windows[i])
            # In the caller's context: the operation's retry budget follows the reads.
            pending[i] = (reader.submit(contextvars.copy_context().run,
                                        self._fetch_window, windows[i], stop), buf)

        try:
            for i, w in enumerate(windows):
                if i not in pending:
                    start(i)
                # The next window is read while this one is committed, unless the two would
                # hold more staging than _MAX_BUFFERED (a chunk over a window).
                nxt = i + 1
                if nxt < len(windows) and (
                        staging.size(w) + staging.size(windows[nxt]) <= _MAX_BUFFERED):
                    start(nxt)
                fut, buf = pending.pop(i)
                fut.result()
                self._commit_window(w, planner)
                staging.release(w, buf)
        except BaseException:
            stop.set()  # the window being read stops at its next item
            for fut, _ in pending.values():
                fut.cancel()
            raise
        finally:
            # The reader thread has ended before this returns or raises, whatever interrupts
            # the wait: it writes into the caller's tensors.
            finish_surely(lambda: reader.shutdown(wait=True))

    def _fetch_window(self, reads: list[_TensorRead], stop: threading.Event | None = None
                      ) -> None:
        """Read ``reads`` (sorted by file and offset) on up to ``num_threads`` streams; ``stop``
        (set by another thread) stops them at their next item."""
        starts = split_runs([r.loc.length for r in reads], self.num_threads, _MIN_STREAM_BYTES)
        runs = [reads[a:b] for a, b in zip(starts, [*starts[1:], len(reads)], strict=True)]
        run_streams(lambda i, halt: self._read_run(runs[i], halt), len(runs),
                    name="ckptmgr-read", stop=stop)

    def _commit_window(self, reads: list[_TensorRead], planner: LoadPlanner) -> None:
        """(calling thread) Check the reads of a window that was read and commit them in order:
        a staged chunk is copied into its destinations."""
        for r in reads:
            if not r.ok:
                raise self._corrupt(f"checksum mismatch in the bytes of {r.idx.fqn!r}", r.loc.file)
        for r in reads:
            self.bytes_read += r.loc.length
            if r.direct:
                planner.commit_tensor(r.items[0], r.dest)
                continue
            for ri in r.items:
                src = r.dest
                for dim, (off, length) in enumerate(
                        zip(ri.storage_offsets, ri.lengths, strict=True)):
                    src = src.narrow(dim, off, length)
                target = planner.resolve_tensor(ri).detach()
                target.copy_(src)
                planner.commit_tensor(ri, target)

    def _read_run(self, reads: list[_TensorRead], stop: threading.Event) -> None:
        """(stream thread) Read one run: each stretch of items in one storage streamed by it
        when it can (:class:`StreamReads`: local files not in the page cache), else in vectored
        reads (:meth:`_read_batched`)."""
        located = [self._locate(r.loc.file) for r in reads]
        i = 0
        while i < len(reads):
            storage = located[i][0]
            j = i + 1
            while j < len(reads) and located[j][0] is storage:
                j += 1
            if not (isinstance(storage, StreamReads) and self._stream(
                    storage, reads[i:j], [path for _, path in located[i:j]], stop)):
                self._read_batched(reads[i:j], stop)
            i = j

    def _stream(self, storage: StreamReads, reads: list[_TensorRead], paths: list[str],
                stop: threading.Event) -> bool:
        """(stream thread) Read ``reads`` (at ``paths`` of ``storage``) as one stream,
        checksumming each item as it completes; False when the storage declines (nothing was
        read)."""
        views = [tensor_memoryview(r.dest) for r in reads]
        stream = storage.stream_into([(path, r.loc.offset, v)
                                      for r, path, v in zip(reads, paths, views, strict=True)])
        if stream is None:
            return False
        try:
            for k in stream:
                if stop.is_set():
                    raise Stopped
                r = reads[k]
                if self.verify:
                    r.ok = checksum(views[k]) == r.loc.checksum
        finally:
            close = getattr(stream, "close", None)  # a generator: stops its I/O threads now
            if close is not None:
                close()
        return True

    def _read_batched(self, reads: list[_TensorRead], stop: threading.Event) -> None:
        """(stream thread) Read adjacent items of a file in one vectored read per _BATCH bytes;
        each piece is checksummed right after it lands."""
        readers: dict[str, _RangeReader] = {}
        # (read, view of its destination) pieces of the batch being built; they are adjacent.
        batch: list[tuple[_TensorRead, memoryview, bool]] = []
        batch_file = ""
        batch_start = batch_end = 0

        def flush() -> None:
            nonlocal batch
            if not batch:
                return
            if stop.is_set():
                raise Stopped
            reader = readers.get(batch_file)
            if reader is None:
                reader = readers[batch_file] = _RangeReader(*self._locate(batch_file))
            reader.readv_into(batch_start, [view for _, view, _ in batch])
            if self.verify:
                for r, view, last in batch:
                    if r.hasher is None:
                        r.hasher = Hasher()
                    r.hasher.update(view)
                    if last:
                        r.ok = r.hasher.value() == r.loc.checksum
                        r.hasher = None
            batch = []

        try:
            for r in reads:
                mv = tensor_memoryview(r.dest)
                n = len(mv)
                if batch and (r.loc.file != batch_file or r.loc.offset != batch_end
                              or len(batch) >= _BATCH_ITEMS):
                    flush()
                if not batch:
                    batch_file, batch_start = r.loc.file, r.loc.offset
                    batch_end = batch_start
                if n == 0:
                    r.ok = not self.verify or checksum(b"") == r.loc.checksum
                    continue
                pos = 0
                while pos < n:
                    take = min(n - pos, _BATCH - (batch_end - batch_start))
                    batch.append((r, mv[pos:pos + take], pos + take == n))
                    pos += take
                    batch_end += take
                    if batch_end - batch_start >= _BATCH:
                        flush()
                        batch_file, batch_start = r.loc.file, batch_end
            flush()
        finally:
            for reader in readers.values():
                reader.close()

    def _read_value(self, loc: ItemLocation, items: list[ReadItem], planner: LoadPlanner) -> None:
        fqn = items[0].storage_index.fqn
        # Anything but tagged JSON is unpickled below: never without trust, whatever it says.
        if loc.enc != "json" and not self.trusted:
            where = "CkptStorageReader(..., trusted=True)" if self._standalone else "trusted=True"
            raise UnsafeCheckpointError(
                f"{fqn!r} was stored with pickle; pass {where} to restore it only if you "
                "trust who wrote this checkpoint", step=self.manifest.step)
        buf = bytearray(loc.length)
        self._read(loc, memoryview(buf))
        self._verify(loc, memoryview(buf), fqn)
        value: Any = None
        if loc.enc == "json":
            try:
                value = decode_value(bytes(buf))
            except ValueError as e:
                raise self._corrupt(f"value of {fqn!r} does not decode: {e}", loc.file) from e
        elif isinstance(planner, CkptLoadPlanner):
            value = torch.load(io.BytesIO(buf), weights_only=False)
        if isinstance(planner, CkptLoadPlanner):
            for ri in items:
                planner.load_value(ri, value)
            return
        # Another planner (DCP's default) loads values from torch.save bytes: made here from the
        # decoded JSON value (so what it unpickles is ours), or the stored pickle when trusted.
        if loc.enc == "json":
            out = io.BytesIO()
            torch.save(value, out)
            data = out.getvalue()
        else:
            data = bytes(buf)
        for ri in items:
            planner.load_bytes(ri, io.BytesIO(data))
