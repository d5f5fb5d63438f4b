"""The item and file checksums of one data file, in the file's order: piece by piece as the
bytes are written (:func:`hash_item`), or on a thread of their own behind the thread that writes
them (:class:`HashBehind`, ``ckptmgr.dcp.writer.HASH_BEHIND``; docs/performance.md, "Round 5")."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from ckptmgr._threads import finish_surely
from ckptmgr.codec.checksum import Hasher
from ckptmgr.dcp._streams import Stopped

__all__ = ["BEHIND_BATCH", "BEHIND_MAX", "HashBehind", "hash_item"]

BEHIND_MAX = 256 << 20  # bytes queued for the hashing thread at most (then the stream waits)
BEHIND_BATCH = 4 << 20  # bytes handed to the hashing thread at once, at least (or the rest)


def hash_item(mv: memoryview, file_hash: Hasher, piece: int, *,
              write: Callable[[memoryview], None] | None = None,
              stopped: Callable[[], bool] | None = None) -> str:
    """The checksum of item ``mv``, added to ``file_hash`` too, ``piece`` bytes at a time (so
    the second checksum reads from cache); each piece is handed to ``write`` once hashed, where
    given (so the write copies from cache too). ``stopped``: checked before each piece; once it
    says so, the rest is left out (the checksums are then of no use)."""
    h = Hasher()
    for off in range(0, len(mv), piece):
        if stopped is not None and stopped():
            break
        part = mv[off:off + piece]
        h.update(part)
        file_hash.update(part)
        if write is not None:
            write(part)
    return h.value()


class HashBehind:
    """The checksums of one data file (each item's and the file's, in the file's order) made on
    a thread of their own, behind the stream's thread, which meanwhile copies the next items into
    the storage's buffers (local direct I/O): refilling a buffer the disk has just emptied then
    costs the copy only. Items go over in batches of at least ``BEHIND_BATCH`` bytes (one
    hand-over per item cost 18 us of GIL hand-offs: 816 tiny tensors saved in 78 ms instead of
    63). Each queued view's owner is kept until it is hashed, and at most ``BEHIND_MAX`` bytes
    wait (the stream waits beyond), so a starved hashing thread never holds more than that of
    temporaries (a GPU tensor's host copy) alive.

    Call order: :meth:`pad` and :meth:`item` ..., then :meth:`value` (waits; raises a failure),
    and always :meth:`stop` (drops what is still queued and waits; a no-op after ``value``).

    Args:
        piece: bytes hashed at a time, into both checksums (so the second reads from cache).
    """

    def __init__(self, piece: int) -> None:
        self._piece = piece
        # Batches of (slot in sums, or -1 for padding; bytes; their owner)
        self._queue: queue.SimpleQueue[list[tuple[int, memoryview, Any]] | None] = (
            queue.SimpleQueue())
        self._batch: list[tuple[int, memoryview, Any]] = []
        self._batch_bytes = 0
        self._file = Hasher()
        self.sums: list[str] = []
        self._failure: BaseException | None = None
        self._stopped = False
        self._waiting = 0  # bytes handed over and not hashed yet
        self._room = threading.Condition()
        thread = threading.Thread(target=self._run, name="ckptmgr-hash", daemon=True)
        thread.start()
        self._thread: threading.Thread | None = thread

    def pad(self, data: bytes) -> None:
        """File bytes of no item (zeros the storage padded with)."""
        self._add(-1, memoryview(data), None)

    def item(self, mv: memoryview, owner: Any) -> int:
        """Queue item bytes ``mv`` (``owner`` keeps them alive); returns its slot in ``sums``."""
        self.sums.append("")
        self._add(len(self.sums) - 1, mv, owner)
        return len(self.sums) - 1

    def _add(self, slot: int, mv: memoryview, owner: Any) -> None:
        self._batch.append((slot, mv, owner))
        self._batch_bytes += len(mv)
        if self._batch_bytes >= BEHIND_BATCH:
            self._hand_over()

    def _hand_over(self) -> None:
        """Queue the batch, once fewer than ``BEHIND_MAX`` bytes wait."""
        if not self._batch:
            return
        batch, nbytes = self._batch, self._batch_bytes
        with self._room:
            self._room.wait_for(lambda: self._waiting <= BEHIND_MAX)
            self._waiting += nbytes
        self._batch, self._batch_bytes = [], 0
        self._queue.put(batch)

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            try:
                for slot, mv, _owner in batch:
                    if self._stopped or self._failure is not None:
                        continue
                    if slot < 0:
                        self._file.update(mv)
                        continue
                    self.sums[slot] = hash_item(mv, self._file, self._piece,
                                                stopped=lambda: self._stopped)
            except BaseException as e:
                self._failure = e
            finally:
                with self._room:
                    self._waiting -= sum(len(mv) for _, mv, _ in batch)
                    self._room.notify_all()
                del batch

    def value(self) -> str:
        """Wait until everything queued is hashed; the file's checksum."""
        self._hand_over()
        self._join()
        if self._failure is not None:
            raise self._failure
        if self._stopped:
            raise Stopped
        return self._file.value()

    def stop(self) -> None:
        """Drop what is queued (the item being hashed too, at its next piece) and wait."""
        self._stopped = True
        self._batch, self._batch_bytes = [], 0
        self._join()

    def _join(self) -> None:
        """Wait for the thread, whatever interrupts (it reads the caller's memory): the end
        of the queue is sent once, then the join is retried until it returns."""
        thread = self._thread
        if thread is None:
            return
        sent = False

        def wait() -> None:
            nonlocal sent
            if not sent:
                self._queue.put(None)
                sent = True
            thread.join()

        finish_surely(wait)
        self._thread = None
