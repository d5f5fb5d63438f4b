"""Our DCP ``StorageWriter``: raw tensor bytes in large sequential writes, JSON metadata, and the
commit protocol of DESIGN.md section 5.

Call order (DCP's, per save):
1) (all ranks) ``reset`` (DCP's ``checkpoint_id``: the standalone writer's URL),
   ``set_up_storage_writer``, ``prepare_local_plan``
2) (coordinator) ``prepare_global_plan``: the standalone writer (``CkptStorageWriter(url)``)
   decides the attempt here, from what the directory holds now (:meth:`StepStore.begin_dir_save`),
   and puts it in every rank's plan; a manager's writer (:meth:`CkptStorageWriter.for_attempt`)
   was given it.
3) (all ranks) ``write_data``: split this rank's items into ``num_threads`` runs of about equal
   bytes (one stream each, only when every stream gets at least 256 MiB), and write each run to
   ``data-<attempt>-r<rank>-<index>.bin`` in the write directory: Python values are encoded first
   (on the calling thread, so an unsafe value fails before any byte is written); tensors are
   resolved on the stream's thread, small ones coalesced into one ``writev`` per 8 MiB, large ones
   handed to the storage's ``write_unbuffered`` where it has one (local direct I/O: copied into
   its huge-page bounce buffers, or with ``COPY_ALL`` off written from the tensor's own memory
   after padding the storage chose, which the file checksum covers) and hashed meanwhile (with
   ``HASH_BEHIND``, on a thread of the stream's own), else hashed and written in 4 MiB pieces.
   Each item and each file get an xxh3-64 checksum, computed in that same pass over the source.
   The files are fsynced; locations go in the results.
4) (coordinator, after every rank's ``write_data`` returned) ``finish``: write the metadata JSON,
   then the manifest, then make it visible: rename the staging directory into place (POSIX), or
   write the manifest object last (object stores, overwrite, and always for the standalone
   writer, which writes in place). Until that last step nothing of the new attempt is visible to
   ``all_steps``, ``restore`` or a reader. The standalone writer then removes the files of the
   attempts it replaced (our exact file names only), or, after a failed commit, its own.

CPU share: by default one stream per rank, so a background save uses about one core for its
checksums and the copy into the bounce buffers (where the local storage writes with direct I/O,
its choice by measurement, I/O threads that mostly sleep in the kernel write from those buffers,
and no kernel time goes to page-cache writeback); with the checksums behind, the two run side by
side on two threads (``HASH_BEHIND``), the same CPU time in all. Stream
threads are ckptmgr's own and can run at a raised nice value (``io_nice``); the default is 0
because a reniced writer, starved by a busy training loop, took 5x longer and cost the loop as
much compute (docs/performance.md). The calling thread is never reniced.
"""

from __future__ import annotations

import contextvars
import dataclasses
import io
import logging
import os
import queue
import secrets
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptmgr._version import __version__
from ckptmgr.codec.checksum import Hasher, checksum, content_digest
from ckptmgr.codec.layout import (
    SHARED_DIR,
    data_file_name,
    join,
    metadata_file_name,
    parse_step_name,
    shared_chunk_path,
    shared_temp_path,
)
from ckptmgr.codec.manifest import (
    FORMAT_VERSION,
    SHARED_FORMAT_VERSION,
    FileEntry,
    Manifest,
    utc_now_iso,
)
from ckptmgr.codec.metadata import ItemLocation
from ckptmgr.codec.values import MAX_VALUE_BYTES, NotRepresentableError, encode_value
from ckptmgr.config import check_flag
from ckptmgr.dcp._args import check_options, check_url
from ckptmgr.dcp._streams import Stopped, run_streams, split_runs
from ckptmgr.dcp.hash_behind import HashBehind, hash_item
from ckptmgr.dcp.metadata import encode_metadata
from ckptmgr.dcp.planner import item_bytes
from ckptmgr.dcp.tensor_bytes import lower_thread_priority, tensor_memoryview, wait_staged
from ckptmgr.errors import ConfigError, SaveError, StorageError, UnsafeCheckpointError
from ckptmgr.step_store import CommitPlan, StepStore, unfenced
from ckptmgr.storage import (
    AtomicRename,
    Storage,
    VectoredWriter,
    is_url_supported,
    open_storage,
    redact_url,
)

__all__ = ["DEFAULT_IO_NICE", "DEFAULT_NUM_THREADS", "SHARE_MIN_BYTES", "CkptStorageWriter",
           "CommitPlan", "EncodedValue", "encode_object"]

log = logging.getLogger("ckptmgr")
_FILE_MARK = "\x00ckptmgr-file:"
_SHARED_MARK = "\x00ckptmgr-shared:"
SHARE_MIN_BYTES = 16 << 10
"""With ``reuse_unchanged=True``, tensor chunks of at least this many bytes go to shared chunks;
smaller ones stay in the step's data file (a file of its own would cost more than its bytes)."""

# Items up to _SMALL bytes are coalesced into one vectored write per _BATCH bytes (or _BATCH_ITEMS
# items); larger ones are hashed and written in _PIECE pieces, so the write copies from cache.
_SMALL = 1 << 20
_BATCH = 8 << 20
_BATCH_ITEMS = 256
_PIECE = 4 << 20
# Make the checksums behind the copies, on a thread of their own (HashBehind), where the
# storage takes items whole (local direct I/O): refilling the buffers that a batch of completed
# writes handed back then costs the copy only. Off: handing items over one at a time, a 1 GiB
# save took 0.961 and 0.938 the time (27/40 and 25/40 pairs), but a save of 816 tiny tensors
# 78 ms instead of 63 (GIL hand-offs per item); handed over in 4 MiB batches, tiny saves cost
# nothing more and the 1 GiB gain was gone (15/30 and 13/30 pairs; docs/performance.md,
# "Round 5"). It is there to be measured on many-core hosts (benchmarks/disk_ab.sh pairs it).
HASH_BEHIND = False
_CHUNK_WRITERS = 8  # shared chunks written (and fsynced) at once per rank
_ZEROS = bytes(64 << 10)  # file padding before an item the storage aligned
# A second stream only pays off with enough bytes for each (measured in docs/performance.md).
_MIN_STREAM_BYTES = 256 << 20
DEFAULT_NUM_THREADS = 1
"""Streams per rank when the caller does not choose: one saturates the local disk measured here."""
DEFAULT_IO_NICE = 0
"""Nice increment of the stream threads when the caller does not choose."""


@dataclasses.dataclass(frozen=True)
class EncodedValue:
    """A Python value already encoded as it is stored (``encoding`` "json" or "pickle"): how the
    training process hands values to the writer process, which writes the bytes as they are and
    never decodes (never unpickles) them."""

    data: bytes
    encoding: str


def encode_object(fqn: str, obj: Any, *, trusted: bool, standalone: bool = False
                  ) -> tuple[bytes, str]:
    """The stored bytes and encoding of Python value ``obj`` under ``fqn``: JSON when it is
    representable, else pickle (only when ``trusted``). The standalone writer keeps plain DCP's
    view of blobs (bytes need pickle).

    Raises:
        UnsafeCheckpointError: the value needs pickle and not ``trusted``.
        ConfigError: the encoded value is larger than a Python value may be.
    """
    try:
        data, enc = encode_value(obj, allow_bytes=not standalone), "json"
    except NotRepresentableError as e:
        if not trusted:
            if isinstance(obj, (bytes, bytearray, memoryview, io.BytesIO)):
                why = f"{fqn!r} holds {type(obj).__name__} data, which DCP stores with pickle"
            else:
                why = f"{fqn!r} holds {type(obj).__name__}, which needs pickle: {e}"
            how = ("CkptStorageWriter(..., trusted=True) (and read it with a trusted "
                   "CkptStorageReader)" if standalone else "trusted=True to save (and to restore)")
            raise UnsafeCheckpointError(
                f"{why}; store plain values or tensors, or pass {how}") from e
        buf = io.BytesIO()
        torch.save(obj, buf)
        data, enc = buf.getvalue(), "pickle"
    if len(data) > MAX_VALUE_BYTES:
        # A restore refuses what claims more (it would allocate first): refuse it now.
        raise ConfigError(
            f"state value {fqn!r} ({type(obj).__name__}) takes {len(data)} bytes stored, more "
            f"than the {MAX_VALUE_BYTES} bytes a Python value may; store large data as a tensor")
    return data, enc


class _ChunkWriters:
    """Writes of new shared chunks on up to ``num`` threads of their own, beside the write
    streams that hash and hand them over. Plain threads, not ``concurrent.futures``: a save that
    runs while the interpreter exits (it waits for the save in flight) must still write them.

    Call order: :meth:`submit` (any stream thread) ..., then :meth:`finish` (raises the first
    failure), and always :meth:`stop` (waits for every thread; what is still queued is dropped).
    """

    def __init__(self, write: Callable[[str, memoryview, Any], None], num: int) -> None:
        self._write = write
        self._num = num
        self._queue: queue.Queue[tuple[str, memoryview, Any] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._failures: list[BaseException] = []
        self._stopped = False

    def submit(self, digest: str, mv: memoryview, owner: Any) -> None:
        """Queue the write of chunk ``digest`` (``owner`` keeps ``mv`` alive until written)."""
        with self._lock:
            if len(self._threads) < self._num:
                # A copy of the submitting stream's context each: the save's retry budget.
                t = threading.Thread(target=contextvars.copy_context().run, args=(self._run,),
                                     name=f"ckptmgr-chunk-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
        self._queue.put((digest, mv, owner))

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if self._stopped or self._failures:
                continue  # after a failure: drop the rest (finish raises the failure)
            try:
                self._write(*job)
            except BaseException as e:
                with self._lock:
                    self._failures.append(e)
            finally:
                del job

    def finish(self) -> None:
        """Wait until every queued chunk is written; raise the first failure."""
        self._join()
        if self._failures:
            raise self._failures[0]

    def stop(self) -> None:
        """Drop what is still queued and wait for the threads (a no-op after :meth:`finish`)."""
        self._stopped = True
        self._join()

    def _join(self) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        for t in threads:
            t.join()


def _item_size(item: WriteItem, encoded: Mapping[MetadataIndex, tuple[bytes, str]]) -> int:
    if item.type == WriteItemType.BYTE_IO:
        return len(encoded[item.index][0])
    return item_bytes(item)  # the chunk's bytes, not the whole tensor's


@dataclasses.dataclass(frozen=True)
class _Target:
    """What the coordinator puts in each rank's plan (``SavePlan.storage_data``): the attempt
    to write and the rank's index in it."""

    plan: CommitPlan
    rank: int


def _dir_step(url: str) -> int:
    """The step a checkpoint directory's name stands for (``.../run/7`` -> 7), else 0: a
    directory named like a step of a ckptmgr root gets a manifest that root can list."""
    step = parse_step_name(url.rstrip("/").rsplit("/", 1)[-1])
    return 0 if step is None else step


class CkptStorageWriter(StorageWriter):
    """DCP's ``StorageWriter`` for ckptmgr's byte format: raw tensor bytes, JSON metadata,
    checksums, and the commit protocol (data, then metadata, then the manifest).

    Two ways to make one:

    - ``CkptStorageWriter(url)``: a standalone writer for plain ``torch.distributed.checkpoint``
      (``dcp.save(state_dict, storage_writer=CkptStorageWriter(url))``, any planner, any number
      of ranks; DCP's ``checkpoint_id`` argument sets or changes the URL). ``url`` is one
      checkpoint's directory (local path, ``file://``, ``memory://``, ``gs://``, ``s3://``, any
      fsspec URL). The coordinator decides the save's attempt in ``prepare_global_plan`` and
      hands it to every rank in its plan. A directory already holding a checkpoint written
      this way is overwritten atomically (the new manifest replaces the old one, whose files are
      removed after); one holding a plain-DCP checkpoint (``.metadata``) is refused; other files
      in it are left alone.
    - :meth:`for_attempt`: one attempt of a manager's step (the manager decided it already).

    Python values are stored as tagged JSON (the save planner's ``lookup_object`` gives the
    object); one that needs pickle is refused with
    :class:`~ckptmgr.errors.UnsafeCheckpointError` unless ``trusted``. The standalone writer
    counts ``bytes`` and ``io.BytesIO`` entries among those: plain DCP stores them with pickle,
    and a blob in a state dict is usually a serialized object itself.
    """

    def __init__(self, url: str | os.PathLike[str] | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 trusted: bool = False) -> None:
        """
        Args:
            url: the checkpoint directory; None: set by DCP's ``checkpoint_id`` (``reset``).
            storage_options: fsspec options for ``url`` (endpoint, credentials, ...).
            trusted: store values that need pickle (then reading them needs ``trusted`` too).

        Raises:
            ConfigError: a bad argument, or a URL :func:`~ckptmgr.storage.open_storage` refuses
                (no I/O that changes storage happens here).
            BackendNotInstalledError: the URL's fsspec backend is not installed.
        """
        super().__init__()
        self.trusted = check_flag("trusted", trusted)
        self._url = check_url(url, "url")
        self._options = check_options(storage_options, "storage_options")
        self._standalone = True
        self.storage: Storage | None = None
        self.plan: CommitPlan | None = None
        self.rank = 0
        self.num_threads = DEFAULT_NUM_THREADS
        self.io_nice = DEFAULT_IO_NICE
        self.fence: Callable[[], None] | None = None
        self.is_coordinator = False
        self.manifest: Manifest | None = None
        self.bytes_written = 0
        # This save's shared chunks (reuse on): digest -> (entry, written by this rank), and
        # the writes of new ones in flight on the chunk writers.
        self._shared: dict[str, tuple[FileEntry, bool]] = {}
        self._shared_lock = threading.Lock()
        self._chunks: _ChunkWriters | None = None
        if self._url is not None:
            self.storage = open_storage(self._url, self._options)

    @classmethod
    def for_attempt(cls, storage: Storage, plan: CommitPlan, rank: int, *,
                    trusted: bool = False, num_threads: int | None = None,
                    io_nice: int | None = None,
                    fence: Callable[[], None] | None = None) -> CkptStorageWriter:
        """A writer of one save attempt the caller planned already (the manager, the tools):
        every rank writes ``plan``'s files, the coordinator's instance also commits it.

        Args:
            storage: where the step is written.
            plan: the coordinator's decision for this attempt (same on every rank).
            rank: this rank.
            trusted: allow values that need pickle.
            num_threads: streams (threads, files) per rank; None: :data:`DEFAULT_NUM_THREADS`.
            io_nice: raise the nice value of the stream threads by this much (0: leave it;
                None: :data:`DEFAULT_IO_NICE`); meant for background saves, so that training
                keeps its cores.
            fence: called by the coordinator right before the step becomes visible; raises
                to stop the commit (a writer that lost the root's lease).
        """
        writer = cls(trusted=trusted)
        writer._standalone = False
        writer.storage = storage
        writer.plan = plan
        writer.rank = rank
        writer.num_threads = max(1, num_threads or DEFAULT_NUM_THREADS)
        writer.io_nice = DEFAULT_IO_NICE if io_nice is None else io_nice
        writer.fence = fence
        return writer

    @property
    def url(self) -> str | None:
        """The checkpoint directory's URL, credentials redacted (None until one is set)."""
        if self._url is None:
            return self.storage.url if self.storage is not None else None
        return redact_url(self._url)

    def __repr__(self) -> str:
        return f"CkptStorageWriter({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        # DCP's process-based async save pickles the writer: the storage is opened again there.
        state = dict(self.__dict__)
        if self._standalone:
            state["storage"] = None
        state["_shared"], state["_chunks"] = {}, None
        state.pop("_shared_lock", None)  # a lock does not pickle; write_data makes a new one
        return state

    def _storage(self) -> Storage:
        if self.storage is None:
            if self._url is None:
                raise ConfigError(
                    "CkptStorageWriter has no URL: pass one (CkptStorageWriter(url)) or give "
                    "dcp.save a checkpoint_id")
            self.storage = open_storage(self._url, self._options)
        return self.storage

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """(all ranks) A new save begins; ``checkpoint_id`` (DCP's argument) replaces the URL.

        Raises:
            ConfigError: a bad ``checkpoint_id``, or one given to a :meth:`for_attempt` writer.
        """
        self.manifest = None
        if checkpoint_id is not None:
            if not self._standalone:
                raise ConfigError("a CkptStorageWriter made by for_attempt writes its own "
                                  "attempt; it takes no checkpoint_id")
            url = check_url(checkpoint_id, "checkpoint_id")
            if url != self._url:
                self._url, self.storage = url, None
            self._storage()
        if self._standalone:
            self.plan = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """(all ranks) Called by DCP before planning."""
        self.is_coordinator = is_coordinator
        if self._standalone:
            if kwargs.get("use_collectives", True) is False:
                raise ConfigError("CkptStorageWriter needs DCP's collectives (the coordinator "
                                  "hands every rank its attempt); use_collectives=False is not "
                                  "supported")
            self._storage()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """(coordinator) Standalone: decide this save's attempt (from what the directory holds
        now) and put it in every rank's plan."""
        if not self._standalone:
            return plans
        assert self._url is not None, "set_up_storage_writer checked the URL"
        plan = StepStore(self._storage()).begin_dir_save(
            "", step=_dir_step(self._url), world_size=len(plans))
        self.plan = plan
        return [dataclasses.replace(p, storage_data=_Target(plan, rank))
                for rank, p in enumerate(plans)]

    def storage_meta(self) -> StorageMeta | None:
        if self._standalone:
            return StorageMeta(checkpoint_id=self.url, save_id=None)
        assert self.plan is not None, "a for_attempt writer has its plan"
        return StorageMeta(checkpoint_id=None, save_id=self.plan.attempt)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a path or URL this writer can open (no I/O)."""
        return is_url_supported(checkpoint_id)

    def _encode_object(self, fqn: str, obj: Any) -> tuple[bytes, str]:
        if isinstance(obj, EncodedValue):  # encoded by the training process (writer process)
            return obj.data, obj.encoding
        # The standalone writer keeps plain DCP's view of blobs: bytes need pickle.
        return encode_object(fqn, obj, trusted=self.trusted, standalone=self._standalone)

    def _encode_item(self, item: WriteItem, planner: SavePlanner) -> tuple[bytes, str]:
        """A Python value's stored bytes: the raw object from the planner's ``lookup_object``
        (DCP's default planners and ours have it), encoded here; otherwise only the planner's
        pickle bytes exist, which need ``trusted``."""
        lookup = getattr(planner, "lookup_object", None)
        if callable(lookup):
            return self._encode_object(item.index.fqn, lookup(item.index))
        if not self.trusted:
            raise UnsafeCheckpointError(
                f"{item.index.fqn!r}: the planner {type(planner).__name__} hands Python values "
                "over only as pickle (it has no lookup_object); pass trusted=True to store them")
        data = planner.resolve_data(item)
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        if len(raw) > MAX_VALUE_BYTES:
            raise ConfigError(f"state value {item.index.fqn!r} takes {len(raw)} bytes stored, "
                              f"more than the {MAX_VALUE_BYTES} a Python value may")
        return raw, "pickle"

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """(all ranks) Write this rank's items into the attempt's data files (Python values are
        encoded first, so an unsafe one fails before any byte is written)."""
        fut: Future[list[WriteResult]] = Future()
        if self._standalone:
            target = plan.storage_data
            if not isinstance(target, _Target):
                raise SaveError(
                    "CkptStorageWriter got a plan without the coordinator's attempt: a planner "
                    "or storage wrapper replaced the plan's storage_data")
            self.plan, self.rank = target.plan, target.rank
        if not plan.items:
            fut.set_result([])
            return fut
        self._shared = {}
        self._shared_lock = threading.Lock()
        if self.plan is not None and self.plan.reuse is not None:
            self._chunks = _ChunkWriters(self._write_chunk, _CHUNK_WRITERS)
            try:
                results = self._write_items(plan, planner)
                self._chunks.finish()  # every new chunk durable before the commit
            finally:
                self._chunks.stop()  # nothing is written after a failure returns
                self._chunks = None
            written = any(new for _, new in self._shared.values())
            if written and isinstance(self.storage, AtomicRename):
                self.storage.fsync_dir(SHARED_DIR)  # the renamed chunks' names, then the commit
            for digest, (entry, new) in self._shared.items():
                self.bytes_written += entry.size if new else 0
                results.append(WriteResult(
                    index=MetadataIndex(f"{_SHARED_MARK}{self.rank}:{digest}"),
                    size_in_bytes=entry.size if new else 0, storage_data=(self.rank, entry, new)))
        else:
            results = self._write_items(plan, planner)
        fut.set_result(results)
        return fut

    def _write_items(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """Write ``plan``'s items on the streams; their results and the data files'."""
        encoded: dict[MetadataIndex, tuple[bytes, str]] = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                encoded[item.index] = self._encode_item(item, planner)
        items = list(plan.items)
        sizes = [_item_size(i, encoded) for i in items]
        starts = split_runs(sizes, self.num_threads, _MIN_STREAM_BYTES)
        bounds = list(zip(starts, [*starts[1:], len(items)], strict=True))
        runs = [items[a:b] for a, b in bounds]
        run_bytes = [sum(sizes[a:b]) for a, b in bounds]
        outcome = run_streams(
            lambda i, stop: self._write_stream(i, runs[i], run_bytes[i], planner, encoded, stop),
            len(runs), name="ckptmgr-write", always_thread=self.io_nice > 0,
            thread_setup=lambda: lower_thread_priority(self.io_nice))
        results: list[WriteResult] = []
        self.bytes_written = 0
        for index, (stream_results, entry) in enumerate(outcome):
            results.extend(stream_results)
            self.bytes_written += entry.size
            results.append(WriteResult(
                index=MetadataIndex(f"{_FILE_MARK}{self.rank}:{index}"), size_in_bytes=entry.size,
                storage_data=(self.rank, entry)))
        return results

    def _share(self, mv: memoryview, owner: Any) -> tuple[str, str]:
        """(stream thread) The shared chunk that holds ``mv``'s bytes, and their checksum: one
        the save may reference (``plan.reuse``, listed when it began) is referenced, else it is
        written (``owner``: what keeps ``mv``'s memory alive until then). Decided by the
        xxh3-128 of the staged bytes, never by identity."""
        assert self.plan is not None and self.plan.reuse is not None, "reuse is on"
        digest = content_digest(mv)
        path = shared_chunk_path(digest)
        n = len(mv)
        with self._shared_lock:
            done = self._shared.get(digest)
        if done is not None and done[0].size == n:  # the same bytes twice in this save
            return path, done[0].checksum
        size, item_sum = self.plan.reuse.get(digest) or (-1, None)
        new = size != n
        entry = FileEntry(path, n, item_sum if not new and item_sum else checksum(mv))
        with self._shared_lock:
            if digest in self._shared:
                return path, self._shared[digest][0].checksum
            self._shared[digest] = (entry, new)
        if new:
            # Written on the chunk writers (their fsyncs overlap): a file of its own per chunk,
            # made durable one after the other, took 4-8x as long as one data file here.
            assert self._chunks is not None, "write_data made the chunk writers"
            self._chunks.submit(digest, mv, owner)
        return path, entry.checksum

    def _write_chunk(self, digest: str, mv: memoryview, owner: Any) -> None:
        """(chunk writer thread) Write shared chunk ``digest`` atomically: under a temporary
        name, made durable, then renamed into place (POSIX); on object stores the object appears
        whole or not at all, and only chunks absent when the save began are written, so a
        failed write never touches a chunk a committed step references."""
        storage = self.storage
        assert storage is not None, "write_data opened the storage"
        final = shared_chunk_path(digest)
        renames = storage if isinstance(storage, AtomicRename) else None
        path = shared_temp_path(digest, secrets.token_hex(6)) if renames is not None else final
        storage.makedirs(SHARED_DIR)  # here: a save that fails before any chunk makes none
        write_file: Callable[[str, memoryview], None] | None = getattr(
            storage, "write_file", None)  # local storage: one call, no per-file threads
        if write_file is not None:
            write_file(path, mv)
        else:
            writer = storage.open_writer(path, size_hint=len(mv))
            try:
                for off in range(0, len(mv), _PIECE):
                    writer.write(mv[off:off + _PIECE])
                writer.commit()
            except BaseException:
                writer.abort()
                raise
        if renames is not None:
            try:
                renames.rename(path, final)
            except StorageError:
                # Another rank put the same bytes in place first: theirs stand. This temporary
                # file is removed by the clean-up after the commit (nothing else deletes).
                if not (storage.exists(final) and storage.size(final) == len(mv)):
                    raise
        del owner

    def _write_stream(self, index: int, items: list[WriteItem], nbytes: int, planner: SavePlanner,
                      encoded: Mapping[MetadataIndex, tuple[bytes, str]],
                      stop: threading.Event) -> tuple[list[WriteResult], FileEntry]:
        """Write ``items`` (about ``nbytes``) in order to data file ``index``; returns their
        results and the file."""
        assert self.plan is not None and self.storage is not None, "write_data set the attempt"
        name = data_file_name(self.plan.attempt, self.rank, index)
        if self._standalone and self.storage.exists(join(self.plan.write_dir, name)):
            # An earlier save's plan (a planner caching plans hands its cached one back):
            # writing would truncate the committed checkpoint's own file.
            raise SaveError(
                f"{name} exists already: this rank was handed an earlier save's plan (planners "
                "that cache plans across saves, DCP's enable_plan_caching, are not supported by "
                "CkptStorageWriter); nothing was written")
        writer = self.storage.open_writer(join(self.plan.write_dir, name), size_hint=nbytes)
        writev = writer.writev if isinstance(writer, VectoredWriter) else None
        # Local direct I/O writes large items from their own memory (ckptmgr.storage.local).
        unbuffered: Callable[[memoryview, Any], int] | None = getattr(
            writer, "write_unbuffered", None)
        # Where the storage copies (or writes from memory) what it is handed, the checksums are
        # made behind on a thread of their own (started in the try below: a thread that cannot
        # start fails the file like any write); else here, piece by piece as each is written.
        behind: HashBehind | None = None
        file_hash = Hasher()
        # Each item's result, in item order: done, or (index, size, offset, checksum or its slot
        # in behind.sums, encoding) until the hashing thread has made its checksum.
        placed: list[WriteResult | tuple[MetadataIndex, int, int, str | int, str]] = []
        pending: list[memoryview] = []
        alive: list[Any] = []  # owners of the memory that ``pending`` views
        pending_bytes = 0
        pos = 0

        def flush() -> None:
            nonlocal pending_bytes
            if not pending:
                return
            if writev is not None:
                writev(pending)
            else:
                writer.write(pending[0] if len(pending) == 1 else b"".join(pending))
            pending.clear()
            alive.clear()
            pending_bytes = 0

        def file_bytes(data: bytes) -> None:
            if behind is not None:
                behind.pad(data)
            else:
                file_hash.update(data)

        try:
            if unbuffered is not None and HASH_BEHIND:
                behind = HashBehind(_PIECE)
            for item in items:
                if stop.is_set():
                    raise Stopped
                owner: Any
                if item.type == WriteItemType.BYTE_IO:
                    owner, enc = encoded[item.index]
                    mv = memoryview(owner)
                else:
                    t = planner.resolve_data(item)
                    assert isinstance(t, torch.Tensor), "tensor item resolved to bytes"
                    wait_staged(t)  # a background save's staging copy may still be running
                    t = t.detach()
                    if t.device.type != "cpu":
                        t = t.cpu()
                    owner = t.contiguous()
                    mv = tensor_memoryview(owner)
                    enc = "raw"
                n = len(mv)
                if (enc == "raw" and self.plan.reuse is not None and n >= SHARE_MIN_BYTES):
                    shared_path, shared_sum = self._share(mv, owner)
                    placed.append(WriteResult(
                        index=item.index, size_in_bytes=n,
                        storage_data=ItemLocation(shared_path, 0, n, shared_sum, enc)))
                    continue
                item_sum: str | int
                if n <= _SMALL and (unbuffered is None or mv.readonly):
                    if behind is not None:
                        item_sum = behind.item(mv, owner)
                    else:
                        item_sum = checksum(mv)
                        file_hash.update(mv)
                    pending.append(mv)
                    alive.append(owner)
                    pending_bytes += n
                    if pending_bytes >= _BATCH or len(pending) >= _BATCH_ITEMS:
                        flush()
                elif unbuffered is not None and not mv.readonly:
                    flush()
                    # The writer copies it, or writes it from the tensor's own memory (no
                    # copy), small items too: they may continue a run of staging memory. It may
                    # pad first: the padding is file bytes.
                    start = unbuffered(mv, owner)
                    while pos < start:
                        pad = _ZEROS[:start - pos]
                        file_bytes(pad)
                        pos += len(pad)
                    if behind is not None:
                        item_sum = behind.item(mv, owner)
                    else:
                        item_sum = hash_item(mv, file_hash, _PIECE)
                else:
                    flush()
                    if behind is not None:
                        item_sum = behind.item(mv, owner)
                        for off in range(0, n, _PIECE):
                            writer.write(mv[off:off + _PIECE])
                    else:
                        item_sum = hash_item(mv, file_hash, _PIECE, write=writer.write)
                placed.append((item.index, n, pos, item_sum, enc))
                pos += n
            flush()
            file_sum = behind.value() if behind is not None else file_hash.value()
            writer.commit()
        except BaseException:
            if behind is not None:
                behind.stop()  # its backlog is dropped, not hashed while the writer aborts
            writer.abort()
            raise
        finally:
            if behind is not None:
                behind.stop()  # nothing reads the items once this returns or raises
        results: list[WriteResult] = []
        for p in placed:
            if isinstance(p, WriteResult):
                results.append(p)
                continue
            at_index, size, at, summed, encoding = p
            if isinstance(summed, int):
                assert behind is not None, "a checksum slot without the hashing thread"
                summed = behind.sums[summed]
            results.append(WriteResult(index=at_index, size_in_bytes=size,
                                       storage_data=ItemLocation(name, at, size, summed, encoding)))
        return results, FileEntry(name, pos, file_sum)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """(coordinator, after every rank's ``write_data`` returned) Write metadata and
        manifest, then make the step visible. Standalone: a failure removes the attempt's files;
        after the commit, the files of the attempts it replaced are removed."""
        if not self._standalone:
            self._commit(metadata, results)
            return
        assert self.plan is not None and self.storage is not None, "prepare_global_plan ran"
        # Standalone: the caller owns this directory and runs one writer (no lease exists);
        # with a fence (the importer), removals are fenced by it like every other.
        store = StepStore(self.storage, fence=self.fence or unfenced)
        try:
            self._commit(metadata, results)
        except BaseException:
            store.discard(self.plan)
            raise
        store.remove_replaced_attempts(self.plan)

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        p = self.plan
        assert p is not None and self.storage is not None, "the attempt is planned"
        locations: dict[MetadataIndex, ItemLocation] = {}
        files: list[FileEntry] = []
        shared: dict[str, FileEntry] = {}
        bytes_per_rank: dict[int, int] = {r: 0 for r in range(p.world_size)}
        for rank_results in results:
            for wr in rank_results:
                if wr.index.fqn.startswith(_SHARED_MARK):
                    rank, entry, new = wr.storage_data
                    shared.setdefault(entry.path, entry)
                    if new:
                        bytes_per_rank[rank] = bytes_per_rank.get(rank, 0) + entry.size
                elif wr.index.fqn.startswith(_FILE_MARK):
                    rank, entry = wr.storage_data
                    if not entry.path.startswith(f"data-{p.attempt}-"):
                        # A rank wrote another attempt's files (a stale plan): committing would
                        # name files that removing replaced attempts then deletes.
                        raise SaveError(f"rank {rank} wrote {entry.path}, not a file of attempt "
                                        f"{p.attempt}; nothing was committed", step=p.step)
                    files.append(entry)
                    bytes_per_rank[rank] = bytes_per_rank.get(rank, 0) + entry.size
                else:
                    locations[wr.index] = wr.storage_data
        metadata.storage_data = locations
        md_bytes = encode_metadata(metadata)
        md_name = metadata_file_name(p.attempt)
        self.storage.write_bytes(join(p.write_dir, md_name), md_bytes)
        files.append(FileEntry(md_name, len(md_bytes), checksum(md_bytes)))
        bytes_per_rank[self.rank] = bytes_per_rank.get(self.rank, 0) + len(md_bytes)
        manifest = Manifest(
            step=p.step, time=utc_now_iso(), attempt=p.attempt, world_size=p.world_size,
            metadata_file=md_name, files=tuple(sorted(files, key=lambda f: f.path)),
            bytes_per_rank=bytes_per_rank,
            versions={"ckptmgr": __version__, "torch": torch.__version__,
                      "python": sys.version.split()[0]},
            metrics=dict(p.metrics), metadata=dict(p.metadata), mesh=p.mesh,
            byteorder=sys.byteorder,
            format_version=SHARED_FORMAT_VERSION if shared else FORMAT_VERSION,
            shared=tuple(shared[k] for k in sorted(shared)),
        )
        StepStore(self.storage).commit(p, manifest, self.fence)
        self.manifest = manifest
