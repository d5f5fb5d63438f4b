"""The single-in-flight save queue and the reusable staging buffers it copies the state into.

Contract (DESIGN.md section 6):
1) (caller thread) ``Stager.stage`` copies every tensor of the flat state into host buffers that are
   reused across saves (pinned when the source is on a CUDA device) and deep-copies Python
   values, so mutating the live state afterwards never reaches the checkpoint; staged values are
   host tensors (DTensors: host copies plus their layout), so nothing allocates on a device.
2) (caller thread) ``SaveQueue.submit`` starts one worker thread for the job and returns.
3) (worker thread) the job writes, commits and runs retention; its result or exception is kept.
4) (caller thread) ``SaveQueue.wait`` joins the worker and hands back the exception once.
At most one job is in flight; submitting while one runs is a bug (the manager waits first). A
worker thread exists only while a job runs, so interpreter exit waits for the commit instead of
hanging on an idle thread.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import ctypes
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckptmgr._shm import ALIGN, ArenaSet, pack
from ckptmgr._threads import finish_surely
from ckptmgr.dcp.shards import ShardedTensor, StagedDTensor, StagedShards
from ckptmgr.errors import SaveError
from ckptmgr.storage.local import forget_huge_pages, note_huge_pages

__all__ = ["SaveQueue", "Stager", "StagingCopies"]

log = logging.getLogger("ckptmgr")


# Staging buffers of plain CPU tensors (thread mode) lie in memory backed by transparent huge
# pages where the kernel offers them: a direct write from 2 MiB pages hands the disk larger
# requests and pins 512x fewer pages.
HUGE_PAGES = True
_HUGE = 2 << 20


def _thp_enabled() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


_THP = sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE") and _thp_enabled()


def _huge_page_buffers(specs: list[tuple[tuple[int, ...], torch.dtype]]
                       ) -> list[torch.Tensor] | None:
    """Tensors of ``specs``' shapes and dtypes, page-aligned views of one private anonymous
    mapping advised to use huge pages; None where the kernel has none."""
    if not _THP:
        return None
    offsets, sizes, total = pack(specs)
    m = mmap.mmap(-1, max(total, ALIGN) + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # advice only: refused (some sandboxes), 4 KiB pages
        m.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive
    # The local direct writer writes items lying here straight from this memory, adjacent ones
    # as one run (ckptmgr.storage.local.note_huge_pages), until the mapping is freed.
    note_huge_pages(base.data_ptr(), len(m))
    weakref.finalize(m, forget_huge_pages, base.data_ptr())
    start = -base.data_ptr() % _HUGE
    return [base[start + off:start + off + n].view(dt).view(shape)
            for off, n, (shape, dt) in zip(offsets, sizes, specs, strict=True)]


class Stager:
    """Host copies of a flat state dict in buffers reused while the structure is unchanged.

    Nothing here allocates on an accelerator: a DTensor becomes a
    :class:`~ckptmgr.dcp.shards.StagedDTensor` (its local shard's host copy plus the layout it came
    from), never ``DTensor.from_local(host_copy, mesh)``, which would copy it back to the device.
    Buffers are allocated at the first save (that save pre-warms them) and reused by later ones
    while a key's shape and dtype stay the same. Copies from a CUDA device go into pinned buffers
    (only where CUDA is available), non-blocking, on one side stream per device that first waits
    for the device's current stream; :meth:`stage` returns after they have landed.
    """

    def __init__(self, arenas: ArenaSet | None = None) -> None:
        # Shared staging (the writer process maps it): every buffer lies in one of ``arenas``.
        self.arenas = arenas
        self._retired: list[int] = []  # arenas dropped since the writer process last heard
        self._warned_sharded = False
        self._buffers: dict[str, torch.Tensor] = {}
        self._pinned: set[str] = set()
        # Sharded tensors: one buffer per distinct box (replicas are not copied).
        self._shard_buffers: dict[str, dict[Any, torch.Tensor]] = {}
        self._streams: dict[int, Any] = {}  # CUDA device index -> side stream (made once)
        # Huge-page staging: the mapping (its address) each buffer lies in, and its bytes.
        self._huge_of: dict[str, int] = {}
        self._huge_size: dict[int, int] = {}
        self.last_staged_bytes = 0

    def take_retired(self) -> list[int]:
        """The arenas dropped since the last call (the writer process unmaps them)."""
        out, self._retired = self._retired, []
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held by the staging buffers."""
        bufs = [*self._buffers.values(),
                *(b for boxes in self._shard_buffers.values() for b in boxes.values())]
        return sum(b.numel() * b.element_size() for b in bufs)

    @property
    def pinned_nbytes(self) -> int:
        """Bytes of the staging buffers that are pinned (page-locked) host memory."""
        if self.arenas is not None:
            return self.arenas.pinned_nbytes
        return sum(_nbytes(self._buffers[k]) for k in self._pinned)

    def release(self) -> None:
        """Drop every buffer."""
        self._buffers.clear()
        self._pinned.clear()
        self._huge_of.clear()
        self._huge_size.clear()
        self._shard_buffers.clear()
        self._streams.clear()
        if self.arenas is not None:
            self.arenas.close()

    def _stale(self, key: str, src: torch.Tensor) -> bool:
        """Whether ``key`` has no buffer fit for ``src`` (none, or another shape or dtype)."""
        buf = self._buffers.get(key)
        return buf is None or buf.shape != src.shape or buf.dtype != src.dtype

    def _allocate_huge(self, flat: Mapping[str, Any]) -> None:
        """(thread mode) One huge-page mapping for every plain CPU tensor whose buffer is
        missing or changed (:func:`_huge_page_buffers`); for all of them instead when the
        mappings that unchanged keys keep alive would hold more than a quarter more than the
        state (a mapping is freed only once none of its buffers is in use, so replacing
        shifting subsets of keys would otherwise pile mappings up)."""
        plain = {}
        for key, value in flat.items():
            src = value.to_local() if isinstance(value, DTensor) else value
            if isinstance(src, torch.Tensor) and _plain_cpu(src):
                plain[key] = src
        stale = [k for k, src in plain.items() if self._stale(k, src)]
        if not stale:
            return
        kept = {self._huge_of[k] for k in plain if k not in stale and k in self._huge_of}
        held = sum(self._huge_size[m] for m in kept)
        live = sum(_nbytes(src) for src in plain.values())
        if held + sum(_nbytes(plain[k]) for k in stale) > live * 5 // 4 + _HUGE:
            stale = list(plain)
        bufs = _huge_page_buffers([(tuple(plain[k].shape), plain[k].dtype) for k in stale])
        if bufs is None:
            return
        mapping = bufs[0].untyped_storage().data_ptr()
        for key, buf in zip(stale, bufs, strict=True):
            self._buffers[key] = buf
            self._pinned.discard(key)
            self._huge_of[key] = mapping
        self._huge_size[mapping] = sum(_nbytes(b) for b in bufs)
        used = set(self._huge_of.values())
        self._huge_size = {m: n for m, n in self._huge_size.items() if m in used}

    def _buffer(self, key: str, src: torch.Tensor) -> torch.Tensor:
        if self._stale(key, src):
            pin = src.device.type == "cuda" and torch.cuda.is_available()
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
            (self._pinned.add if pin else self._pinned.discard)(key)
        return self._buffers[key]

    def _allocate_shared(self, flat: Mapping[str, Any]) -> None:
        """(shared staging) One new arena for every tensor whose buffer is missing or changed."""
        assert self.arenas is not None
        keys, specs = [], []
        for key, value in flat.items():
            if isinstance(value, ShardedTensor):
                if not self._warned_sharded:
                    self._warned_sharded = True
                    log.warning("state key %r is an XLA sharded tensor: async_mode='process' "
                                "writes tensors and DTensors; a state with XLA sharded tensors "
                                "is saved from a thread of the training process", key)
                continue
            src = value.to_local() if isinstance(value, DTensor) else value
            if not isinstance(src, torch.Tensor):
                continue
            if self._stale(key, src):
                keys.append(key)
                specs.append((tuple(src.shape), src.dtype))
        if specs:
            for key, buf in zip(keys, self.arenas.allocate(specs), strict=True):
                self._buffers[key] = buf
                self._pinned.discard(key)

    def _copy(self, buf: torch.Tensor, src: torch.Tensor, used: dict[int, Any],
              moves: list[tuple[int, int, int]]) -> None:
        """Copy ``src`` into host ``buf``: on a CUDA side stream (non-blocking into pinned
        memory); a plain CPU tensor as a memmove queued on ``moves`` (:func:`_memmove_all`);
        else a plain copy (other devices, or CUDA tensors without a CUDA runtime, as fake
        tensors in tests are)."""
        if src.device.type == "cuda" and torch.cuda.is_available():
            index = src.device.index if src.device.index is not None else 0
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
            if index not in used:
                # The side stream sees every kernel queued so far that writes the state.
                stream.wait_stream(torch.cuda.current_stream(index))
                used[index] = stream
            with torch.cuda.stream(stream):
                buf.copy_(src, non_blocking=buf.is_pinned())
        elif _plain_cpu(src) and src.dtype == buf.dtype and src.shape == buf.shape:
            if _nbytes(src):
                moves.append((buf.data_ptr(), src.data_ptr(), _nbytes(src)))
        else:
            buf.copy_(src)
        self.last_staged_bytes += _nbytes(buf)

    def stage(self, flat: Mapping[str, Any]) -> dict[str, Any]:
        """Copy ``flat`` (flat key -> tensor or Python value) into staging; returns the copy.

        Tensors become host tensors, DTensors :class:`StagedDTensor` values, sharded tensors
        :class:`StagedShards`; Python values are deep-copied. Blocks until every device-to-host
        copy has landed.

        Raises:
            ConfigError: a DTensor with a Partial placement.
        """
        out, copies = self.stage_deferred(flat)
        if copies is not None:
            copies.run()
        return out

    def stage_deferred(self, flat: Mapping[str, Any]
                       ) -> tuple[dict[str, Any], StagingCopies | None]:
        """:meth:`stage`, except the copies of plain CPU tensors, which are returned to be run
        (:meth:`StagingCopies.run`) after the save that writes them has started; None: there
        are none. Everything else (device copies, values) has landed when this returns.

        Raises:
            ConfigError: a DTensor with a Partial placement.
        """
        out: dict[str, Any] = {}
        used: dict[int, Any] = {}
        moves: list[tuple[int, int, int]] = []
        self.last_staged_bytes = 0
        if self.arenas is not None:
            with torch.no_grad():
                self._allocate_shared(flat)
        elif HUGE_PAGES:
            with torch.no_grad():
                self._allocate_huge(flat)
        try:
            with torch.no_grad():
                for key, value in flat.items():
                    if not isinstance(value, ShardedTensor):
                        self._shard_buffers.pop(key, None)  # the key held a sharded tensor
                    if isinstance(value, DTensor):
                        local = value.to_local()  # under no_grad: the local tensor itself
                        buf = self._buffer(key, local)
                        self._copy(buf, local, used, moves)
                        out[key] = StagedDTensor.from_dtensor(key, value, buf)
                    elif isinstance(value, ShardedTensor):
                        self._drop(key)
                        staged = StagedShards.stage(value, self._shard_buffers.setdefault(key, {}))
                        self.last_staged_bytes += sum(_nbytes(t) for t in staged.local_shards())
                        out[key] = staged
                    elif isinstance(value, torch.Tensor):
                        buf = self._buffer(key, value)
                        self._copy(buf, value, used, moves)
                        out[key] = buf
                    else:
                        out[key] = copy.deepcopy(value)
        finally:
            for stream in used.values():
                stream.synchronize()  # the copies have landed (also when one failed)
        for key in set(self._buffers) - set(flat):
            self._drop(key)
        for key in set(self._shard_buffers) - set(flat):
            del self._shard_buffers[key]
        if self.arenas is not None:
            self._retired += self.arenas.retire_unused(self._buffers.values())
        return out, StagingCopies(moves) if moves else None

    def _drop(self, key: str) -> None:
        self._buffers.pop(key, None)
        self._pinned.discard(key)
        self._huge_of.pop(key, None)


_MOVE_CHUNK = 16 << 20  # a large tensor is copied in pieces, so that threads can share it
_MOVE_ALONE = 8 << 20  # below this many bytes in all, one thread copies


class StagingCopies:
    """The copies of one staging into its buffers (``(dst, src, nbytes)`` memmoves), run on the
    caller's thread after the background save that writes them has started, so that the disk
    is busy while the state is still being copied. The writer reads no staging buffer before its
    copy has landed: this is a gate (:func:`~ckptmgr.dcp.tensor_bytes.wait_staged`) while
    :meth:`run` runs."""

    def __init__(self, moves: list[tuple[int, int, int]]) -> None:
        self._moves = moves
        self._by_address = sorted(range(len(moves)), key=lambda i: moves[i][0])
        self._starts = [moves[i][0] for i in self._by_address]
        self._landed = [threading.Event() for _ in moves]
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._blocking_s: float | None = None

    def wait_ready(self, address: int) -> None:
        """(writer) Return once the copy into the buffer holding ``address`` has landed (at
        once for an address in none of them).

        Raises:
            SaveError: staging failed, so the buffer's bytes are not the state's.
        """
        k = bisect.bisect_right(self._starts, address) - 1
        if k < 0:
            return
        i = self._by_address[k]
        dst, _, n = self._moves[i]
        if address >= dst + n:
            return
        self._landed[i].wait()
        if self._error is not None:
            raise SaveError("this save's copy of the state into staging failed "
                            f"({type(self._error).__name__}: {self._error}); nothing of it "
                            "was committed") from self._error

    def run(self, t_call: float | None = None) -> None:
        """(caller) Copy everything; the save's blocking time is taken when the last copy
        landed (from ``t_call``). A failure is raised here and to every writer waiting."""
        try:
            _memmove_all(self._moves, landed=lambda i: self._landed[i].set())
        except BaseException as e:
            self.abort(e)
            raise
        if t_call is not None:
            self._blocking_s = time.perf_counter() - t_call
        self._done.set()

    def abort(self, error: BaseException) -> None:
        """(caller) Staging failed or was interrupted: every writer waiting now or later for a
        buffer not yet landed raises, so nothing of this save is committed. Idempotent; called
        before the caller waits for the job (which then cannot wait forever)."""
        if self._error is None:
            self._error = error
        for ev in self._landed:  # after _error: a waiter woken by a failure raises
            ev.set()
        self._done.set()

    def blocking_s(self) -> float:
        """(writer) How long the caller was blocked (``run``'s ``t_call`` to its end); waits
        for :meth:`run` to end."""
        self._done.wait()
        return self._blocking_s if self._blocking_s is not None else 0.0


def _cpus() -> int:
    """CPUs this process may run on (its affinity: a container's share), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _copy_workers() -> int:
    """Threads that copy a staging (:func:`_memmove_all`), before the number of pieces."""
    return min(4, torch.get_num_threads(), _cpus())


def _memmove_all(moves: list[tuple[int, int, int]],
                 landed: Callable[[int], None] | None = None) -> None:
    """Run the queued ``(dst, src, nbytes)`` copies with memmove on a few threads (the GIL is
    released), each taking the next piece when done: not torch's ``copy_``, whose intra-op
    threads a busy training loop holds and which waits for the slowest of them on every tensor
    (1 GiB on 2 loaded cores: copy_ 0.10-4.35 s, median 0.95 s; one memmove thread 0.14-0.17 s;
    quiet: copy_ 0.08 s, two memmove threads 0.09 s, one 0.15 s). ``landed(i)``: called once
    move ``i``'s last piece has been copied."""
    pieces = [(i, dst + off, src + off, min(_MOVE_CHUNK, n - off))
              for i, (dst, src, n) in enumerate(moves) for off in range(0, n, _MOVE_CHUNK)]
    left = [-(-n // _MOVE_CHUNK) for _, _, n in moves]
    workers = min(_copy_workers(), len(pieces))
    if workers <= 1 or sum(n for *_, n in moves) < _MOVE_ALONE:
        for i, *piece in pieces:
            ctypes.memmove(*piece)
            left[i] -= 1
            if landed is not None and left[i] == 0:
                landed(i)
        return
    todo = iter(pieces)
    lock = threading.Lock()
    failed: list[BaseException] = []  # a copy that failed on any thread: raised here
    stopping = [False]  # no piece is taken once set

    def work() -> None:
        try:
            while True:
                with lock:
                    piece = None if failed or stopping[0] else next(todo, None)
                if piece is None:
                    return
                i, *copy_args = piece
                ctypes.memmove(*copy_args)
                with lock:
                    left[i] -= 1
                    last = left[i] == 0
                if last and landed is not None:
                    landed(i)
        except BaseException as e:
            with lock:
                failed.append(e)  # the others stop taking pieces

    helpers = [threading.Thread(target=work, name="ckptmgr-stage", daemon=True)
               for _ in range(workers - 1)]
    try:
        for t in helpers:
            t.start()
        work()
    except BaseException as e:  # a thread that could not start
        with lock:
            failed.append(e)
    finally:
        # No helper goes on writing into the buffers once this returns or raises (a later save
        # reuses them), whatever interrupts the joins.
        with lock:
            stopping[0] = True
        for t in helpers:
            if t.ident is not None:
                finish_surely(t.join)
    if failed:
        raise failed[0]


def _plain_cpu(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are its values, contiguous in CPU memory (a memmove copies it)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and not t.is_quantized)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class SaveQueue:
    """Runs at most one save job at a time on a worker thread; keeps its failure for the caller."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> bool:
        """Whether a job is running now."""
        t = self._thread
        return t is not None and t.is_alive()

    def has_failed(self) -> bool:
        """Whether a finished job left an error that was not handed back yet."""
        with self._lock:
            return not self.in_flight and self._error is not None

    def submit(self, job: Callable[[], None], *, name: str) -> None:
        """Start ``job`` on a new worker thread.

        Raises:
            RuntimeError: a job is still in flight (the caller must ``wait`` first).
        """
        if self.in_flight:
            raise RuntimeError("a save is already in flight")

        def run() -> None:
            try:
                job()
            except BaseException as e:
                # Kept for the next save/join/close; logged now so a process that exits without
                # joining still reports it.
                log.error("background save failed: %s: %s", type(e).__name__, e)
                with self._lock:
                    self._error = e

        thread = self._thread = threading.Thread(target=run, name=name, daemon=False)
        try:
            thread.start()
        except Exception:
            # The thread could not be started (no job runs: nothing to wait for). A Ctrl-C in
            # start()'s wait for the new thread is no Exception: that thread runs, and is waited
            # for like any job.
            self._thread = None
            raise

    def wait(self) -> BaseException | None:
        """Wait for the job in flight; return its exception (once), or None."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        with self._lock:
            err, self._error = self._error, None
        return err
