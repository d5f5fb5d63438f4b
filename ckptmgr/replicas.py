"""Peer replicas of the local tier: which ranks hold a copy of which rank's local step, and the
point-to-point transfer of one step's files between ranks (``local_replicas``).

Each rank's node is ``GROUP_RANK`` (torchrun's node rank) when set, else the host name. With ``k``
replicas, rank ``r``'s local step is also held by one rank on each of the ``k`` distinct nodes
that follow ``r``'s node in a ring over the sorted node ids (the rank of the same local index
there, modulo that node's number of ranks): a replica is never on the rank's own node, and losing
up to ``k`` nodes leaves a copy of every part. Fewer than ``k + 1`` nodes: ``nodes - 1`` replicas.

A transfer (:func:`exchange`) moves whole committed step directories as uint8 tensors over a gloo
group in bounded pieces (:data:`PIECE`). Every rank runs one schedule of *rounds*: in each round
every outgoing stream posts its next message (``isend``) and every incoming one its next buffer
(``irecv``), then all are waited for. A stream's messages are: a header (the manifest's length,
-1 when the sender cannot read its copy), the manifest's bytes, then every file of the manifest
in pieces; the receiver knows every size from the header and the manifest, so both sides agree
on the schedule without a collective. The receiver (:class:`Receiver`) checks the manifest (whose
part, which save), writes into a staging directory of its own store, checks every file's size
and checksum against the manifest, then commits with the store's protocol (manifest last, rename).
A failure on the receiver's side still drains the stream, so the sender never waits on it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ckptmgr._dist import Comm
from ckptmgr.codec.checksum import Hasher
from ckptmgr.codec.layout import join, step_dir_name
from ckptmgr.codec.manifest import Manifest, decode_manifest
from ckptmgr.errors import CkptmgrError, StorageError
from ckptmgr.step_store import CommitPlan, StepStore

__all__ = ["PIECE", "Receiver", "Replicator", "Sender", "exchange", "node_id", "plan_holders"]

log = logging.getLogger("ckptmgr")

PIECE = 32 << 20
"""Bytes per message of a transfer: bounds the memory a stream holds (one piece per peer)."""


def node_id() -> str:
    """This process's node: ``GROUP_RANK`` (torchrun) when set, else the host name."""
    return os.environ.get("GROUP_RANK") or socket.gethostname()


def _node_order(node: str) -> tuple[int, int | str]:
    # Numeric node ranks sort as numbers (2 before 10); host names as text after them.
    return (0, int(node)) if node.isdigit() else (1, node)


def plan_holders(nodes: Sequence[str], k: int) -> list[list[int]]:
    """For each rank, the ranks that hold a replica of its local step.

    Args:
        nodes: each rank's node id, by rank.
        k: replicas wanted; at most ``distinct nodes - 1`` are placed.
    """
    ring = sorted(set(nodes), key=_node_order)
    by_node: dict[str, list[int]] = {n: [] for n in ring}
    for r, n in enumerate(nodes):
        by_node[n].append(r)
    k = min(k, len(ring) - 1)
    out: list[list[int]] = []
    for r, n in enumerate(nodes):
        pos, index = ring.index(n), by_node[n].index(r)
        out.append([by_node[ring[(pos + j) % len(ring)]][index % len(by_node[ring[(pos + j)
                                                                                   % len(ring)]])]
                    for j in range(1, k + 1)])
    return out


def _tensor(data: bytes | bytearray) -> torch.Tensor:
    return torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data,
                            dtype=torch.uint8)


class Sender:
    """The messages that send ``store``'s committed ``step`` (the whole directory)."""

    def __init__(self, store: StepStore, step: int) -> None:
        self.store, self.step = store, step
        self.bytes = 0

    def messages(self) -> Iterator[torch.Tensor]:
        """Header, manifest, then each file in pieces (zeros where a read fails: the receiver's
        checksum then refuses the copy, and the schedule both sides follow stays intact)."""
        try:
            m, raw = self.store.read_manifest_bytes(self.step)
        except (CkptmgrError, StorageError) as e:
            log.warning("%s: cannot send step %d: %s", self.store.url, self.step, e)
            yield torch.tensor([-1], dtype=torch.int64)
            return
        yield torch.tensor([len(raw)], dtype=torch.int64)
        yield _tensor(raw)
        sdir = step_dir_name(self.step)
        for entry in m.files:
            offset = 0
            while offset < entry.size:
                buf = bytearray(min(PIECE, entry.size - offset))
                try:
                    self.store.storage.read_into(join(sdir, entry.path), offset, memoryview(buf))
                except (CkptmgrError, StorageError, OSError) as e:
                    log.warning("%s: reading step %d for a peer failed: %s", self.store.url,
                                self.step, e)
                yield _tensor(buf)
                self.bytes += len(buf)
                offset += len(buf)


class Receiver:
    """Receives a step into ``store`` (a staging directory, checked, then committed).

    Args:
        store: where the copy goes (a replica directory, or the rank's own when it heals).
        step: the step.
        check: why the sender's manifest is not the copy wanted (whose part, which save), or None.
    """

    def __init__(self, store: StepStore, step: int, check: Callable[[Manifest], str | None]
                 ) -> None:
        self.store, self.step, self._check = store, step, check
        self.error: str | None = "nothing received"
        self.bytes = 0

    def buffers(self) -> Generator[torch.Tensor, None, None]:
        """The buffers to receive into, in order; each is filled before the next is asked for.
        Sets :attr:`error` (None: committed)."""
        header = torch.empty(1, dtype=torch.int64)
        yield header
        n = int(header[0])
        if n < 0:
            self.error = "its holder could not read its copy"
            return
        raw_t = torch.empty(n, dtype=torch.uint8)
        yield raw_t
        raw = raw_t.numpy().tobytes()
        m = decode_manifest(raw, expected_step=self.step)  # the sender's own, validated copy
        why = self._check(m)
        plan, why = (None, why) if why is not None else self._begin(m)
        for entry in m.files:
            writer: Any = None
            if why is None and plan is not None:
                try:
                    writer = self.store.storage.open_writer(join(plan.write_dir, entry.path),
                                                            entry.size)
                except (CkptmgrError, StorageError, OSError) as e:
                    why = f"cannot write {entry.path}: {e}"
            h, got = Hasher(), 0
            while got < entry.size:
                buf = torch.empty(min(PIECE, entry.size - got), dtype=torch.uint8)
                yield buf
                view = buf.numpy().data.cast("B")
                h.update(view)
                got += len(view)
                self.bytes += len(view)
                if writer is not None:
                    try:
                        writer.write(view)
                    except (CkptmgrError, StorageError, OSError) as e:
                        why = f"cannot write {entry.path}: {e}"
                        writer = _abort(writer)
            if writer is not None and h.value() != entry.checksum:
                why = f"{entry.path}: checksum differs"
                writer = _abort(writer)
            if writer is not None:
                try:
                    writer.commit()
                except (CkptmgrError, StorageError, OSError) as e:
                    why = f"cannot write {entry.path}: {e}"
        if why is None and plan is not None:
            why = self._commit(plan, raw)
        elif plan is not None:
            self.store.discard(plan)
        self.error = why

    def _begin(self, m: Manifest) -> tuple[CommitPlan | None, str | None]:
        """A staged attempt (the sender's attempt id: the file names carry it), or why not; a
        committed copy already there is another save (the caller's check says which one is
        wanted): removed first, through the store's fenced door."""
        try:
            if self.step in self.store.scan().committed:
                self.store.delete_step(self.step)
            plan = self.store.begin_save(self.step, forced=False, overwrite=False,
                                         world_size=m.world_size, on_exists="skip",
                                         attempt=m.attempt)
        except (CkptmgrError, StorageError) as e:
            return None, f"cannot write into {self.store.url}: {e}"
        if plan is None:
            return None, f"{self.store.url} holds a foreign directory for step {self.step}"
        return plan, None

    def _commit(self, plan: CommitPlan, raw: bytes) -> str | None:
        try:
            self.store.commit(plan, raw)
        except (CkptmgrError, StorageError) as e:
            self.store.discard(plan)
            return f"commit failed: {e}"
        return None


def _abort(writer: Any) -> Any:
    """Abort ``writer``; None (no writer any more)."""
    try:
        writer.abort()
    except Exception as e:  # the copy is refused anyway
        log.debug("abort of a refused replica file failed: %s", e)
    return None


def exchange(group: Any, sends: Sequence[tuple[int, Sender]],
             recvs: Sequence[tuple[int, Receiver]]) -> None:
    """(every rank that sends or receives) Run the streams in rounds over ``group`` (peers are
    ranks of ``group``). Returns when every stream ended.

    Raises:
        RuntimeError (torch's): a peer failed or timed out.
    """
    outs = [(peer, s.messages()) for peer, s in sends]
    ins = [(peer, r.buffers()) for peer, r in recvs]
    out_next = [next(gen, None) for _, gen in outs]
    in_next = [next(gen, None) for _, gen in ins]
    while any(t is not None for t in out_next) or any(b is not None for b in in_next):
        works = [dist.isend(t, group=group, group_dst=peer)
                 for (peer, _), t in zip(outs, out_next, strict=True) if t is not None]
        works += [dist.irecv(b, group=group, group_src=peer)
                  for (peer, _), b in zip(ins, in_next, strict=True) if b is not None]
        for w in works:
            if w is not None:
                w.wait()
        out_next = [None if t is None else next(gen, None)
                    for (_, gen), t in zip(outs, out_next, strict=True)]
        in_next = [None if b is None else next(gen, None)
                   for (_, gen), b in zip(ins, in_next, strict=True)]
    for _, gen in ins:  # a receiver's last step (its commit) ran at its last next()
        gen.close()


class Replicator:
    """The background thread of replica transfers, with its own group (a gloo group is used by
    one thread at a time). One transfer at a time: :meth:`start` waits for the previous one."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._thread: threading.Thread | None = None
        self.broken = False  # a transfer failed in the group: no more transfers on this rank

    def start(self, fn: Callable[[], None], name: str) -> None:
        """Run ``fn`` in the background (after the transfer before it)."""
        self.wait()
        if self.broken:
            return
        # Not a daemon: an interpreter that exits without close() waits for the transfer (its
        # peers run theirs too), as for saves; a daemon thread killed inside a gloo call aborted
        # the process (exit status 134) and left the step without its replicas.
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=False)
        self._thread.start()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # the local step stays whole without its replicas
            self.broken = True
            log.error("peer replica transfer failed (%s: %s); no further replicas are sent by "
                      "this rank", type(e).__name__, e)

    @property
    def in_flight(self) -> bool:
        """Whether a transfer runs now."""
        t = self._thread
        return t is not None and t.is_alive()

    def wait(self) -> None:
        """Wait for the transfer in flight, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Wait, then destroy the group."""
        self.wait()
        self.comm.destroy()
