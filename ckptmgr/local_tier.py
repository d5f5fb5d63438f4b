"""The fast node-local tier (``local_path``): one world-size-1 checkpoint per rank and step.

The durable tier (the root, :mod:`ckptmgr.durable`) holds one world-size-N checkpoint per step.
The local tier is per rank: rank ``r`` writes its own files under
``<local_path>/rank-<r>``, a root of its own (its own :class:`~ckptmgr.step_store.StepStore`,
writer lease, commit protocol and checksums) holding a *world-size-1* checkpoint of this rank's
local view of the state:

- plain tensors and Python values as they are;
- a DTensor as its local shard, a plain tensor, with the chunk it covers (global shape, offsets,
  sizes) recorded in the step's manifest, so it is put back only into a DTensor of the same
  layout.

No process group is used to write or read a local step, so a rank never needs another node's
disk. The ranks agree on which local steps are whole (every rank holds it, committed, it
verifies, and every rank holds the *same save* of it) with one ``all_gather`` at construction
and after each local save; only those are listed, restored or counted by retention. The save is
named by a save id that every rank computes alike without a collective (a token the ranks agree
on when the tier opens, and the number of local saves since) and records in its manifest: a rank
whose re-save of a step failed still holds the older save, so the step is not whole; and a step
whose last save failed on any rank is not whole anywhere (deleted by every rank).

A read that fails (an I/O error) is not a finding: a rank that cannot read its copy of a step
reports it *unread*, not damaged. A step owed to the durable tier (:attr:`LocalTier.owed` on any
rank) that is not whole only because some ranks could not read their own parts (every other part
verified, one save: :func:`_in_doubt`, from the gathered reports, alike on every rank) is never
deleted for it: its files and replicas stay on every rank until its durable copy is made (the
copy reads every byte again) or some rank finds its part damaged, missing or another save. It is
not listed or restored from this tier meanwhile (when the tier opens, its save is recorded as
dropped). docs/multitier.md "Durable copies from the local files".

Peer replicas (``local_replicas`` = k, :mod:`ckptmgr.replicas`): each rank's step is also held by
k ranks of other nodes under ``<local_path>/rank-<holder>/replicas/rank-<src>/<step>/`` (inside
the holder's own directory, fenced by its lease), sent by a background thread on a group of its
own after the save's agreement. A replica counts towards whole steps like the rank's own copy
(verified, same save id); a restore first heals the ranks whose own copy is missing or damaged
from a holder. docs/multitier.md "Peer replicas".

Each local step belongs to one durable root: its manifest records the root (``root`` in
:data:`LAYOUT_KEY`, :func:`durable_root_key`). A step of another root (another run given the same
``local_path``) is *foreign*: never listed, verified, restored, uploaded, replicated over, healed
over or deleted; one warning per tier says how many there are. A save of a step number a foreign
step holds on any rank is not written to the local tier at all (every rank alike; the durable
tier saves it as due). A step written before roots were recorded belongs to this run unless its
upload record names another root (one warning; the two spellings compared normalised: a local
path's real path, a URL without a trailing ``/``). A step whose manifest this version cannot
decode (damaged, or written by a newer ckptmgr) is judged by the root recorded in its raw JSON:
another root's is foreign; one naming this root, or none, is this run's damaged step, and local
retention deletes it at the next save (as before). A step whose manifest cannot be read (an I/O
error) is taken as foreign until it reads again (looked at again at each save's agreement):
never deleted or written over meanwhile; the ranks' agreement counts it as a copy this rank could
not read (as a data read error), so that the other ranks keep an owed step's parts too.
Another root's replicas held here are looked at again at each agreement too.
docs/multitier.md "Another run's local steps".

Call order (every collective over the caller's ``comm``, same order on every rank):
1) (all ranks) :meth:`LocalTier.open` in the constructor: lease, scan, verify, agree (with
   replicas: place the holders, make the transfer group).
2) (all ranks) :meth:`LocalTier.save` for a due step: wait for the previous replica transfer,
   write this rank's step, agree on the outcome, then apply local retention (a step is deleted,
   with its replicas, only after a newer one committed on every rank); then start this step's
   replica transfer in the background (:meth:`LocalTier.wait_replicas` waits for it).
3) (all ranks) :meth:`LocalTier.restore`: with replicas, ranks lacking their own copy receive it
   from a holder; agree that every rank can read the step (files, sizes, layout) before reading;
   read; agree that every rank succeeded. False means: every rank falls back to the durable tier.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ckptmgr._dist import Comm
from ckptmgr.codec.checksum import Hasher
from ckptmgr.codec.layout import MANIFEST_NAME, join, new_attempt_id, step_dir_name
from ckptmgr.codec.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    check_json_depth,
    decode_manifest,
)
from ckptmgr.config import ManagerConfig
from ckptmgr.dcp import shards
from ckptmgr.dcp.checkpoint import (
    SavePlanners,
    load_step,
    prepare_restore,
    prime_unprimed_optimizers,
    read_restore_source,
    write_step,
)
from ckptmgr.dcp.state import flatten_state
from ckptmgr.errors import (
    CheckpointNotFoundError,
    CkptmgrError,
    ConfigError,
    CorruptCheckpointError,
    LeaseError,
    RestoreError,
    SaveError,
    StateMismatchError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptmgr.info import StepInfo
from ckptmgr.lease import Lease
from ckptmgr.replicas import Receiver, Replicator, Sender, exchange, node_id, plan_holders
from ckptmgr.step_store import CommitPlan, StepStore
from ckptmgr.storage import Storage, is_not_found, open_storage, redact_url, split_scheme

__all__ = ["LAYOUT_KEY", "UPLOAD_KEY", "LocalTier", "check_local_path", "durable_root_key",
           "is_read_failure", "local_view"]

log = logging.getLogger("ckptmgr")

LAYOUT_KEY = "_ckptmgr_local_tier"
"""Manifest metadata key of a local step: rank, world size, each DTensor's chunk, the save id and
the durable root it belongs to (``root``: :func:`durable_root_key`; absent in steps written
before roots were recorded)."""
UPLOAD_KEY = "_ckptmgr_upload"
"""Manifest metadata key of a local step due on the durable tier: what its durable copy needs
(the mesh description, trusted); :mod:`ckptmgr.uploader` sets and reads it."""

_READ_PIECE = 8 << 20
# A staged host copy of a DTensor's local shard, where the staging makes one (save_async).
_STAGED_DTENSOR: Any = getattr(shards, "StagedDTensor", None)


def _chunk_of(value: Any) -> dict[str, Any]:
    """Global shape and this rank's chunk of a DTensor (live or staged)."""
    chunks = list(value.__create_chunk_list__())
    return {"shape": [int(d) for d in value.shape],
            "chunks": [[[int(o) for o in c.offsets], [int(s) for s in c.sizes]] for c in chunks]}


def local_view(flat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's local view of a flat state: DTensors become their local shard (a plain tensor
    sharing its memory); the chunk of each is returned beside.

    Raises:
        ConfigError-free: a sharded XLA tensor raises TypeError (the local tier cannot hold it).
    """
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    layout: dict[str, Any] = {}
    with torch.no_grad():
        for key, value in flat.items():
            if isinstance(value, DTensor):
                out[key] = value.to_local()
                layout[key] = _chunk_of(value)
            elif _STAGED_DTENSOR is not None and isinstance(value, _STAGED_DTENSOR):
                pieces = value.local_shards()
                out[key] = pieces[0] if pieces else torch.empty(0, dtype=value.dtype)
                layout[key] = _chunk_of(value)
            elif isinstance(value, shards.ShardedTensor):
                raise TypeError(f"{key} is a sharded XLA tensor")
            else:
                out[key] = value
    return out, layout


@dataclass(frozen=True)
class _Held:
    """What one rank reports about one of its local steps: whether it verifies, and which save
    wrote it (None: a step written before save ids existed). ``unread``: it does not verify
    because a read failed (an I/O error), not because what was read is wrong; ``save`` is then
    the one its manifest names, if that was read."""

    step: int
    ok: bool
    save: str | None = None
    unread: bool = False


# What one rank reports: its own steps, and the replicas it holds as (source rank, step).
_Report = tuple[list[_Held], list[tuple[int, _Held]]]
REPLICAS_DIR = "replicas"
"""Sub-directory of a rank's own directory holding its replicas: ``replicas/rank-<src>/<step>``."""
DROPPED_NAME = ".ckptmgr-local-dropped.json"
"""File at the top of a rank's own directory naming the saves (step, save id) that are whole no
more: dropped by local retention while their files stay (owed to the durable tier), or
forgotten. Read at construction (every rank's, joined) so that none is listed again after a
restart, whatever happened to the newer steps meanwhile."""
_MAX_DROPPED_BYTES = 16 << 20


def check_local_path(cfg: ManagerConfig) -> None:
    """Check ``local_path`` before anything is written (the constructor calls this first).

    Raises:
        ConfigError: it names something that is not a directory, or a directory that cannot
            be created here (its nearest existing parent is not a writable directory).
    """
    if not cfg.local.path:
        return
    path = os.path.abspath(os.path.expanduser(cfg.local.path))
    parent = path
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    fix = "pass a directory on node-local disk (it is created if missing), or local_path=None"
    if not os.path.isdir(parent):
        raise ConfigError(f"local_path {cfg.local.path!r}: {parent!r} exists and is not a "
                          f"directory; {fix}")
    if parent != path and not cfg.read_only and not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"local_path {cfg.local.path!r} cannot be created: no write permission "
                          f"on {parent!r}; {fix}")


def durable_root_key(storage: Storage) -> str:
    """How a local step names the durable root it belongs to: the root as its storage normalised
    it (a local root's absolute path, ``~`` expanded; fsspec's protocol and path, no trailing
    ``/``), credentials never included. Spellings of one root (``file://``, ``/`` at the end, a
    relative path) give one key."""
    root = getattr(storage, "root", None)
    if not isinstance(root, str):  # a Storage of another kind: the URL it shows
        return storage.url
    fs = getattr(storage, "fs", None)
    if fs is None:  # a local root: one directory reached through a link is one root
        root = os.path.realpath(root)
    unstrip = getattr(fs, "unstrip_protocol", None)
    return redact_url(unstrip(root) if callable(unstrip) else root)


def _shown_root_key(url: str) -> str:
    """A durable root as an upload record shows it (its storage's ``url``: the user's spelling),
    normalised as :func:`durable_root_key` normalises a root: a local path (or ``file://``)
    absolute (from this process's working directory), ``~`` expanded, its real path; a URL
    without a trailing ``/``. Two spellings of one root compare equal."""
    scheme, rest = split_scheme(url)
    if scheme in (None, "file", "local") and rest:
        try:
            return os.path.realpath(os.path.abspath(os.path.expanduser(rest)))
        except (ValueError, OSError):  # bytes from storage: a NUL, a path too long; as it is
            return rest
    return url.rstrip("/") or url


# How a verification of a rank's copy ends (:meth:`LocalTier._check_in`).
_OK, _DAMAGED, _IO_ERROR = "ok", "damaged", "io-error"

_UNREAD = "unknown: its manifest cannot be read now"
"""What :meth:`LocalTier._classify` gives for a step whose manifest cannot be read (an I/O
error): whose it is cannot be told, so it is treated as another root's until it reads again."""


class LocalTier:
    """This rank's node-local tier and the steps all ranks agreed on.

    Args:
        cfg: the manager's config (``cfg.local.path`` is set).
        comm: the caller-thread group (ranks agree over it).
        durable: the durable root's storage: the local steps of this run are the ones recorded
            as this root's (None: every step is this run's, as before roots were recorded).
    """

    def __init__(self, cfg: ManagerConfig, comm: Comm, durable: Storage | None = None) -> None:
        assert cfg.local.path is not None and cfg.local.interval is not None
        self.interval = cfg.local.interval
        self.max_to_keep = cfg.local.max_to_keep
        self.rank, self.world_size = comm.rank, comm.world_size
        self._read_only = cfg.read_only
        self._take_over = cfg.take_over
        self.root = os.path.join(os.path.abspath(os.path.expanduser(cfg.local.path)),
                                 f"rank-{comm.rank}")
        self.store: StepStore | None = None
        self.lease: Lease | None = None
        self.steps: list[int] = []  # agreed: committed and verified on every rank, ascending
        self._planners = SavePlanners()
        self._warned = False
        self._bad: set[int] = set()  # this rank's committed steps that did not verify
        # Of those, the ones whose verification failed by an I/O error (not by what was read):
        # step -> the save its manifest names (None: not read). Kept while owed: _in_doubt.
        self._read_failed: dict[int, str | None] = {}
        # Agreed: steps owed their durable copy that are not whole only because some rank could
        # not read its own part (step -> the save); never listed, but uploadable (_in_doubt).
        self._doubt: dict[int, str | None] = {}
        self._saves: dict[int, str | None] = {}  # this rank's committed steps: their save ids
        self._agreed_saves: dict[int, str | None] = {}  # whole steps: the save every rank holds
        self._session = ""  # agreed when the tier opens; with _num_saves, names each save
        self._num_saves = 0
        self.owed: set[int] = set()  # due on the durable tier, not uploaded yet: kept (uploader)
        self.last_failure: str | None = None  # why the last restore of a step fell back
        self.last_failure_touched = False  # whether that restore had written into the target
        # Whether every failure of that restore was about the target state, not the step
        # (_target_kind: "unsafe", or "mismatch"): the step is kept and listed.
        self.last_target: str | None = None
        # Peer replicas (docs/multitier.md "Peer replicas"); a reader never writes or heals, so
        # it ignores them.
        self.replicas = 0 if cfg.read_only else cfg.local.replicas
        self.holders: list[list[int]] = [[] for _ in range(self.world_size)]  # by source rank
        self._replicator: Replicator | None = None
        self._rep_stores: dict[int, StepStore] = {}  # source rank -> its replicas held here
        self._rep_saves: dict[tuple[int, int], str | None] = {}  # verified (src, step) -> save
        # Agreed: step -> source rank -> the other ranks holding a verified copy of its part.
        self._holders_of: dict[int, dict[int, list[int]]] = {}
        self._void: set[int] = set()  # agreed on every rank: not whole, whatever anyone holds
        # Saves (step, save id) never whole again: every rank's record joined at construction,
        # and the ones dropped since; and what this rank's record (DROPPED_NAME) holds.
        self._dropped: set[tuple[int, str | None]] = set()
        self._recorded: set[tuple[int, str | None]] = set()
        self._borrowed: dict[int, Manifest] = {}  # whole steps this rank holds no own copy of
        self.replica_bytes_sent = 0  # bytes this rank sent to its holders (measurements)
        # The durable root this run's local steps record (key), and the URL it is shown as
        # (what an upload record of a step written before roots were recorded names).
        self.durable_key = None if durable is None else durable_root_key(durable)
        self._durable_url = None if durable is None else durable.url
        # Another root's committed steps (another run given this local_path): never listed,
        # restored, uploaded, written over or deleted. This rank's own (step -> that root), the
        # replicas held here, and the step numbers a foreign step holds on any rank (agreed):
        # a save of such a step skips the local tier (:attr:`last_skipped`).
        self._foreign: dict[int, str] = {}
        self._foreign_reps: dict[tuple[int, int], str] = {}
        self._collide: set[int] = set()
        self._legacy: set[int] = set()  # steps that record no root (written before they did)
        self.last_skipped = False  # the last save skipped the local tier (alike on every rank)

    @classmethod
    def open(cls, cfg: ManagerConfig, comm: Comm,
             replica_comm: Callable[[], Comm] | None = None, *,
             durable: Storage | None = None) -> LocalTier:
        """(collective) Open this rank's directory (taking its writer lease unless read-only),
        verify every committed local step (sizes and checksums) and agree on the whole ones.

        With ``local_replicas`` > 0 it also verifies the replicas this rank holds (they count
        towards whole steps), places the holders of each rank's part by node, and makes the
        transfer thread's own group with ``replica_comm`` (collective, every rank alike).
        ``durable``: the durable root's storage (the steps of other roots are left alone).

        Raises:
            LeaseError, StorageError, ConfigError: on any rank, raised on every rank.
        """
        tier = cls(cfg, comm, durable)
        try:
            held = comm.agree(tier._open_and_verify)
            # The saves any rank recorded as dropped travel with the foreign steps (no more
            # collectives): a rank that crashed before writing its record is covered by the
            # others, and a replaced node's empty directory forgets nothing.
            found = comm.all_gather((sorted(tier._foreign), sorted(tier._dropped, key=str)))
            tier._collide = {s for foreign, _ in found for s in foreign}
            tier._dropped = {(int(s), v) for _, d in found for s, v in d}
            # The coordinator's clock leads the token: of two saves of one step that are both
            # whole (a node back with a stale directory), the newer one is chosen.
            tier._session = comm.broadcast(f"{time.time_ns():x}.{new_attempt_id()}")
            gathered: list[_Report] = comm.all_gather(held)
            tier._agreed_saves, tier._holders_of = _whole(gathered, comm.world_size)
            tier._doubt = _in_doubt(gathered, comm.world_size, tier._agreed_saves)
            # Listed as local retention keeps them: the newest ``max_to_keep`` whole steps that
            # no rank recorded as dropped. The dropped ones (kept on disk for their durable
            # copy) are not counted: a newer step damaged since must not bring one back. Older
            # whole steps (a crash before local retention ran, or a step kept for its durable
            # copy) are never listed again either (recorded now); they stay only for the copy a
            # restart owes the durable tier (ckptmgr.uploader: :meth:`upload_candidates`, which
            # lists them all), and go at the next local save.
            whole = [s for s, save in sorted(tier._agreed_saves.items())
                     if (s, save) not in tier._dropped]
            tier.steps = whole[-tier.max_to_keep:]
            tier._void.update(s for s in tier._agreed_saves if s not in tier.steps)
            # A step some rank could not read (an I/O error) was not whole when the ranks
            # agreed: never listed from this tier, now or after a restart (recorded), but its
            # owed durable copy is still made from it (upload_candidates; the copy's reads check
            # every byte) and its files stay while it is owed (_agree_and_prune).
            tier._void.update(tier._doubt)
            tier._drop({s: tier._agreed_saves[s] for s in whole[:-tier.max_to_keep]}
                       | tier._doubt)
            if tier.replicas:
                tier._open_replicas(comm, gathered, replica_comm)
        except BaseException:
            tier.close()
            raise
        tier._warn_foreign()
        lost = sorted({h.step for h in held[0]} - set(tier._agreed_saves))
        if lost:
            log.warning("local tier %s: steps %s are not whole on every rank (a replaced node, "
                        "a corrupt or unfinished save, or a read that failed): not restorable "
                        "from the local tier", tier.root, lost)
        return tier

    def _open_replicas(self, comm: Comm, gathered: list[_Report],
                       replica_comm: Callable[[], Comm] | None) -> None:
        """(collective) Place the holders by node, start the transfer thread's group, and borrow
        a manifest of every whole step this rank holds no own copy of (for :meth:`step_info`)."""
        nodes: list[str] = comm.all_gather(node_id())
        self.holders = plan_holders(nodes, self.replicas)
        placed = len(self.holders[0])
        if placed < self.replicas:
            log.warning("local_replicas=%d but the job spans %d node(s) (GROUP_RANK, else the "
                        "host name): each local step is held on %d other node(s); replicas are "
                        "never placed on a rank's own node", self.replicas, len(set(nodes)),
                        placed)
        if placed and replica_comm is not None:
            self._replicator = Replicator(replica_comm())
        # The lowest rank holding a verified copy of any part lends its manifest to the ranks
        # that hold none of their own (a replaced node, before its restore heals it).
        needed = {s for s in self.steps for r, (own, _) in enumerate(gathered)
                  if not any(h.ok and h.step == s and h.save == self._agreed_saves[s]
                             for h in own)}
        lend: dict[int, bytes] = {}
        for s in sorted(needed):
            agreed = self._agreed_saves[s]
            lender = min(r for r, (own, reps) in enumerate(gathered)
                         if any(h.ok and h.step == s and h.save == agreed for h in own)
                         or any(h.ok and h.step == s and h.save == agreed for _, h in reps))
            store = self._copy_store(s) if lender == self.rank else None
            try:
                if store is not None:
                    lend[s] = store.read_manifest_bytes(s)[1]
            except (CkptmgrError, StorageError) as e:  # step_info of it then fails there only
                log.warning("local tier %s: cannot read step %d's manifest: %s", self.root, s, e)
        for lent in comm.all_gather(lend):
            for s, raw in lent.items():
                if s not in self._borrowed and s not in self._own_agreed():
                    self._borrowed[s] = decode_manifest(raw, expected_step=s)

    def _own_agreed(self) -> set[int]:
        return {s for s in self.steps if s not in self._bad
                and self._saves.get(s, "-") == self._agreed_saves.get(s)}

    def _copy_store(self, step: int) -> StepStore | None:
        """A store of this rank holding a verified copy of whole ``step`` (its own first)."""
        if step in self._own_agreed():
            return self.store
        for src, store in sorted(self._rep_stores.items()):
            if self._rep_saves.get((src, step), "-") == self._agreed_saves.get(step):
                return store
        return None

    def _rep_store(self, src: int) -> StepStore:
        """The store of the replicas of rank ``src``'s part held here (fenced by our lease)."""
        store = self._rep_stores.get(src)
        if store is None:
            path = os.path.join(self.root, REPLICAS_DIR, f"rank-{src}")
            store = StepStore(open_storage(path, writable=not self._read_only),
                              fence=self.lease.check if self.lease is not None else None)
            self._rep_stores[src] = store
        return store

    def _replica_sources(self) -> list[int]:
        """Source ranks whose replica directories exist here (any number: a directory of an
        earlier world size is listed, and deleted by retention since nothing in it verifies)."""
        base = os.path.join(self.root, REPLICAS_DIR)
        try:
            names = os.listdir(base)
        except FileNotFoundError:
            return sorted(self._rep_stores)
        except OSError as e:  # a file there, no permission: this rank lists what it knows
            # Raising here would leave the other ranks waiting in the agreement that follows.
            log.warning("local tier %s: cannot list %s (%s): only the replicas this process "
                        "wrote are counted; remove or fix it", self.root, base, e)
            return sorted(self._rep_stores)
        found = {int(n[5:]) for n in names if n.startswith("rank-") and n[5:].isdigit()
                 and not os.path.islink(os.path.join(base, n))
                 and os.path.isdir(os.path.join(base, n))}
        return sorted(found | set(self._rep_stores))

    def _open_and_verify(self) -> _Report:
        if not self._read_only:
            try:
                os.makedirs(self.root, exist_ok=True)
            except OSError as e:  # checked at construction; here only what that cannot see
                raise ConfigError(f"local_path: cannot create {self.root!r}: {e}; pass a "
                                  "directory on node-local disk, or local_path=None") from e
        self.store = StepStore(open_storage(self.root, writable=not self._read_only))
        if not self._read_only:
            self.lease = Lease(self.store.storage)
            try:
                self.lease.acquire(take_over=self._take_over)
            except LeaseError as e:  # the lease is the directory's, whatever the root
                raise LeaseError(
                    f"{e} (this is the local tier, local_path: its writer lease belongs to the "
                    "directory, whichever run writes it; jobs running at the same time need a "
                    "local_path each, and take_over=True would stop the other job's local "
                    "saves)") from e
            self.store.fence = self.lease.check  # every commit and removal checks it
        self._dropped = self._recorded = self._read_dropped()
        held: list[_Held] = []
        for step in self.store.scan().committed:
            other = self._classify(self.store, step, note_legacy=True)
            if other is not None:  # not read further: it is never ours to verify or delete
                self._foreign[step] = other
                if other == _UNREAD:
                    # Whose it is cannot be told, but it may be this run's step, owed and
                    # whole elsewhere: reported as a copy this rank could not read (never a
                    # finding), so that the other ranks keep theirs (_in_doubt).
                    held.append(self._unread_own(step))
                continue
            status, save = self._verifies(step)
            held.append(_Held(step, status == _OK, save, unread=status == _IO_ERROR))
            if status != _OK:
                self._bad.add(step)
            if status == _IO_ERROR:
                self._read_failed[step] = save
        reps: list[tuple[int, _Held]] = []
        for src in self._replica_sources() if self.replicas else ():
            store = self._rep_store(src)
            for step in store.scan().committed:
                other = self._classify(store, step)
                if other is not None:
                    self._foreign_reps[(src, step)] = other
                    continue
                ok, save = self._verify_in(store, step, src)
                if ok:
                    self._rep_saves[(src, step)] = save
                reps.append((src, _Held(step, ok, save)))
        return held, reps

    def _unread_own(self, step: int) -> _Held:
        """What this rank reports of its ``step`` whose manifest it cannot read (an I/O error):
        a copy it could not read, of a save it cannot name (matching any: :func:`_in_doubt`).
        Left alone meanwhile (taken as another root's: never deleted or written over)."""
        self._bad.add(step)
        self._read_failed.setdefault(step, None)
        return _Held(step, False, self._read_failed[step], unread=True)

    def _read_dropped(self) -> set[tuple[int, str | None]]:
        """The saves this rank recorded as dropped (:data:`DROPPED_NAME`; none if absent). An
        unreadable record is reported and taken as empty: the other ranks' records still
        count, and the positional rule (the newest ``max_to_keep``) still applies."""
        assert self.store is not None
        storage = self.store.storage
        try:
            if not storage.exists(DROPPED_NAME):
                return set()
            if storage.size(DROPPED_NAME) > _MAX_DROPPED_BYTES:
                raise ValueError(f"larger than {_MAX_DROPPED_BYTES} bytes")
            data = storage.read_bytes(DROPPED_NAME)
            check_json_depth(data)  # the parser recurses
            doc = json.loads(data)
            return {(int(s), v) for s, v in doc["dropped"]
                    if isinstance(s, int) and (v is None or isinstance(v, str))}
        except (StorageError, ManifestError, ValueError, KeyError, TypeError,
                RecursionError) as e:
            log.warning("local tier %s: cannot read %s (%s): the steps it names as dropped by "
                        "local retention may be listed again; remove it if it is not "
                        "ckptmgr's", self.root, DROPPED_NAME, e)
            return set()

    def _drop(self, saves: Mapping[int, str | None], *, record: bool = True) -> None:
        """(every rank alike) ``saves`` (step -> save id) are whole no more. With ``record``
        (their files stay on disk: owed to the durable tier, or not deleted yet) this rank's
        record of them is written first, before anything acts on the drop (this agreement's
        deletions, the save's return): a restart never lists them again, even where a newer
        step was damaged since and the newest ``max_to_keep`` would bring one back. A step
        deleted at once needs no record (nothing is left to list). The record keeps the saves
        of the steps still held here (own, another root's, or replicas); best effort (a failure
        is reported: the other ranks' records count too)."""
        self._dropped.update(saves.items())
        new = set(saves.items()) - self._recorded
        if not record or not new or self.store is None or self._read_only:
            return
        try:
            if self.lease is not None:
                self.lease.check()  # another writer owns this directory now: leave it alone
            held = set(self.store.scan().committed)
            for src in self._replica_sources() if self.replicas else ():
                held.update(self._rep_store(src).scan().committed)
            keep = {(s, v) for s, v in self._recorded if s in held} | new
            doc = {"dropped": sorted(([s, v] for s, v in keep), key=str)}
            self.store.storage.write_bytes(DROPPED_NAME, json.dumps(doc).encode())
            self._recorded = keep
        except (CkptmgrError, StorageError) as e:
            log.warning("local tier %s: cannot record that steps %s were dropped by local "
                        "retention (%s): after a restart they may be listed again if a newer "
                        "step is lost", self.root, sorted(s for s, _ in new), e)

    def _verifies(self, step: int) -> tuple[str, str | None]:
        """:meth:`_check_in` of this rank's own copy of ``step``; records its save id when it
        verifies."""
        assert self.store is not None
        status, save = self._check_in(self.store, step, self.rank)
        if status == _OK:
            self._saves[step] = save
        return status, save

    def _verify_in(self, store: StepStore, step: int, owner: int) -> tuple[bool, str | None]:
        """Whether ``store``'s copy of ``step`` is rank ``owner``'s part for this world size and
        every file has the size and checksum of the manifest (reads every byte); its save id."""
        status, save = self._check_in(store, step, owner)
        return status == _OK, save if status == _OK else None

    def _check_in(self, store: StepStore, step: int, owner: int) -> tuple[str, str | None]:
        """How ``store``'s copy of ``step`` verifies as rank ``owner``'s part for this world
        size, every file with the size and checksum of its manifest (reads every byte):
        ``_OK``; ``_DAMAGED`` (what was read is wrong, or a file is missing: a finding); or
        ``_IO_ERROR`` (a read failed: nothing is known about the bytes). With the save id its
        manifest names (None: none, or the manifest was not read)."""
        save: str | None = None
        try:
            m = store.read_manifest(step)
            named = self._check_owner(m, owner).get("save")
            save = named if isinstance(named, str) else None
            storage, sdir = store.storage, step_dir_name(step)
            for entry in m.files:
                path = join(sdir, entry.path)
                if storage.size(path) != entry.size:
                    raise CorruptCheckpointError(f"{entry.path}: size differs", path=entry.path)
                h, offset = Hasher(), 0
                while offset < entry.size:
                    piece = storage.read_bytes(path, offset, min(_READ_PIECE, entry.size - offset))
                    if not piece:
                        break
                    h.update(piece)
                    offset += len(piece)
                if h.value() != entry.checksum:
                    raise CorruptCheckpointError(f"{entry.path}: checksum differs",
                                                 path=entry.path)
        except (CkptmgrError, OSError) as e:  # StorageError is an OSError
            io = is_read_failure(e)
            log.warning("local tier %s: step %d does not verify: %s%s", store.url, step, e,
                        " (a read failed: nothing is known to be wrong with its files)" if io
                        else "")
            return (_IO_ERROR if io else _DAMAGED), save
        return _OK, save

    def other_root(self, m: Manifest) -> str | None:
        """The durable root local step ``m`` belongs to when it is not this run's, else None.

        A step records its root (``root`` in :data:`LAYOUT_KEY`, compared as
        :func:`durable_root_key` makes it). A step written before roots were recorded is this
        run's unless its upload record (:data:`UPLOAD_KEY`) names another root URL: nothing
        else can contradict it (docs/multitier.md "Another run's local steps").
        """
        return self._other_root_in(m.metadata)

    def _other_root_in(self, metadata: Mapping[str, Any]) -> str | None:
        """:meth:`other_root` of a manifest's ``metadata`` (decoded, or read loosely)."""
        if self.durable_key is None:
            return None
        info = metadata.get(LAYOUT_KEY)
        root = info.get("root") if isinstance(info, dict) else None
        if isinstance(root, str):
            return None if root == self.durable_key else root
        # The upload record shows the root as the user spelled it: compared normalised.
        upload = metadata.get(UPLOAD_KEY)
        shown = upload.get("root") if isinstance(upload, dict) else None
        return shown if isinstance(shown, str) and (
            self._durable_url is None
            or _shown_root_key(shown) != _shown_root_key(self._durable_url)) else None

    def _classify(self, store: StepStore, step: int, *, note_legacy: bool = False
                  ) -> str | None:
        """Whose committed ``step`` in ``store`` is: the other root it belongs to, or None (this
        run's, or absent). Reads the manifest only:

        - it decodes: :meth:`other_root` says;
        - it does not decode (damaged, or written by a newer ckptmgr): its JSON is read loosely,
          no larger than a manifest may be, for the same records. It names another root: that
          root's (never deleted, written over or listed). It names this run's root, or none, or
          is no JSON object within that size: None, this run's damaged step (it does not
          verify, so local retention deletes it; as before);
        - it cannot be read (an I/O error): :data:`_UNREAD`, taken as another root's in this
          call (never deleted, written over or listed; a warning at each look), and looked at
          again at the next save's agreement.

        ``note_legacy``: remember a decoded step that records no root (for one warning)."""
        try:
            m = store.read_manifest(step)
        except CheckpointNotFoundError:
            return None
        except StorageError as e:
            return self._unread(store, step, e)
        except CkptmgrError:  # it does not decode (CorruptCheckpointError, UnsafeCheckpointError)
            return self._classify_loosely(store, step)
        other = self.other_root(m)
        info = m.metadata.get(LAYOUT_KEY)
        if note_legacy and other is None and self.durable_key is not None and not (
                isinstance(info, dict) and "root" in info):
            self._legacy.add(step)
        return other

    def _classify_loosely(self, store: StepStore, step: int) -> str | None:
        """:meth:`_classify` of a step whose manifest does not decode: the root recorded in its
        raw JSON (read as :class:`StepStore` reads a manifest: its path, its size limit)."""
        path = join(step_dir_name(step), MANIFEST_NAME)
        try:
            if store.storage.size(path) > MAX_MANIFEST_BYTES:
                return None
            data = store.storage.read_bytes(path)
        except StorageError as e:
            return None if is_not_found(e) else self._unread(store, step, e)
        try:
            check_json_depth(data)  # the parser recurses
            doc = json.loads(data.decode("utf-8"))
        except (ManifestError, ValueError, RecursionError):
            return None
        metadata = doc.get("metadata") if isinstance(doc, dict) else None
        return self._other_root_in(metadata) if isinstance(metadata, dict) else None

    def _unread(self, store: StepStore, step: int, err: StorageError) -> str:
        log.warning("local tier %s: cannot read step %d's manifest (%s): whose step it is cannot "
                    "be told, so it is left alone (not listed, deleted or written over) until it "
                    "reads again; check the disk", store.url, step, err)
        return _UNREAD

    def _warn_foreign(self) -> None:
        """One warning per tier: the steps of other roots found here, and the ones that record
        no root (taken as this run's)."""
        foreign = {s: r for s, r in self._foreign.items() if r != _UNREAD}  # said by _unread
        foreign_reps = {k: r for k, r in self._foreign_reps.items() if r != _UNREAD}
        if foreign or foreign_reps:
            roots = sorted(set(foreign.values()))
            log.warning(
                "local tier %s holds %d local step(s) %s and %d replica(s) of another durable "
                "root (%s), not this run's (%s): another run was given this local_path. They are "
                "ignored: never listed, restored, uploaded, overwritten or deleted, and this run "
                "does not save its own steps of those numbers to the local tier. Give this run "
                "another local_path, or remove them if that run is over", self.root,
                len(foreign), sorted(foreign)[-5:], len(foreign_reps),
                ", ".join(roots[:3]) or "replicas only", self.durable_key)
        legacy = sorted(self._legacy - set(self._foreign))
        if legacy:
            log.warning("local tier %s: %d local step(s) %s were written by an older ckptmgr that "
                        "did not record their durable root: they are taken as this run's (%s); "
                        "remove them if another run wrote them", self.root, len(legacy),
                        legacy[-5:], self.durable_key)

    def _check_owner(self, m: Manifest, owner: int | None = None) -> dict[str, Any]:
        owner = self.rank if owner is None else owner
        other = self.other_root(m)
        if other is not None:
            raise CorruptCheckpointError(
                f"local step {m.step} belongs to another durable root ({other}), not this "
                f"run's ({self.durable_key}); it is left alone", step=m.step)
        info = m.metadata.get(LAYOUT_KEY)
        if not isinstance(info, dict) or info.get("rank") != owner or info.get(
                "world_size") != self.world_size:
            who = {k: info.get(k) for k in ("rank", "world_size")} if isinstance(
                info, dict) else None
            raise CorruptCheckpointError(
                f"step {m.step} was written by another rank or world size ({who}); " + (
                    f"this is rank {owner}" if owner == self.rank else f"expected rank {owner}")
                + f" of {self.world_size}", step=m.step)
        return info

    # ---------------------------------------------------------------------------- saving

    def due(self, step: int) -> bool:
        """Whether ``step`` is due on the local tier by its interval."""
        return step % self.interval == 0

    def save(self, step: int, flat: Mapping[str, Any], comm: Comm, *,
             metrics: Mapping[str, float], metadata: Mapping[str, Any], trusted: bool,
             num_threads: int | None) -> SaveError | None:
        """(collective over ``comm``) Write this rank's local step, agree on the outcome, apply
        local retention. Returns the agreed failure (every rank gets the same), else None.

        A step whose number another root's local step holds on any rank (agreed) is not written
        on any rank (:attr:`last_skipped`; no collective): this run's older save of it, if any,
        is whole no more (it is not the state given now)."""
        err: BaseException | None = None
        nbytes = 0
        self.wait_replicas()  # the previous transfer first: one at a time, retention after it
        self._num_saves += 1  # on every rank alike: the save id needs no collective
        save = f"{self._session}-{self._num_saves}"
        self.last_skipped = self.skips(step, comm)
        if self.last_skipped:
            return None
        try:
            nbytes = self._write(step, flat, metrics, metadata, trusted, num_threads, save)
        except Exception as e:
            err = e
        errors = comm.all_gather(None if err is None else f"{type(err).__name__}: {err}")
        failed = {r: CkptmgrError(e) for r, e in enumerate(errors) if e is not None}
        if failed:  # its last save failed somewhere: not whole anywhere, whatever each holds
            self._bad.add(step)
            self._read_failed.pop(step, None)  # known: no rank's copy is the save given
            self._void.add(step)  # nor by the replicas of an older save of it
        else:
            self._void.discard(step)
        self._agree_and_prune(comm)
        if failed:
            r = min(failed)
            return SaveError(f"local-tier save of step {step} failed on rank {r}: {errors[r]}",
                             step=step, failures=dict(failed))
        log.info("saved step %d to the local tier %s (%d bytes on this rank)", step, self.root,
                 nbytes)
        if self._replicator is not None and step in self.steps:  # alike on every rank
            self._replicator.start(lambda: self._replicate(step, save),
                                   name=f"ckptmgr-replicas-{step}")
        return None

    def skips(self, step: int, comm: Comm) -> bool:
        """(collective over ``comm`` when ``step`` is one another root's local step held at the
        last agreement: every rank alike; no save in flight) Whether a save of ``step`` skips
        this tier: another root's local step of that number is still here on some rank (looked
        at again: it may have been removed by hand since). Then this run's older save of
        ``step``, if any, is whole no more (it is not the state given now) and one warning says
        so."""
        if step not in self._collide:
            return False
        other = None if self.store is None else self._classify(self.store, step)
        if other is None:
            self._foreign.pop(step, None)
        else:
            self._foreign[step] = other
        if not comm.any(other is not None):
            self._collide.discard(step)  # gone on every rank: this run's step from now on
            return False
        self.forget(step)
        log.warning("local tier %s: step %d is not saved to the local tier: another durable "
                    "root's local step %d is there (on %s); it is left alone. Give this run "
                    "another local_path, or remove that run's steps", self.root, step, step,
                    "this rank" if step in self._foreign else "another rank")
        return True

    def _replicate(self, step: int, save: str) -> None:
        """(transfer thread, collective over its own group) Send this rank's committed ``step``
        to its holders, receive the parts this rank holds, then agree on what each holds."""
        assert self._replicator is not None
        rcomm = self._replicator.comm
        assert self.store is not None
        sends = [(h, Sender(self.store, step)) for h in self.holders[self.rank]]
        recvs = [(src, Receiver(self._rep_store(src), step,
                                self._wanted(src, save, self._rep_store(src))))
                 for src in range(self.world_size) if self.rank in self.holders[src]]
        exchange(rcomm.group, sends, recvs)
        self.replica_bytes_sent += sum(sender.bytes for _, sender in sends)
        got: list[int] = []
        for src, receiver in recvs:
            if receiver.error is None:
                self._rep_saves[(src, step)] = save
                got.append(src)
            else:
                self._rep_saves.pop((src, step), None)
                log.warning("local tier %s: the replica of rank %d's step %d was not kept: %s",
                            self.root, src, step, receiver.error)
        for holder, srcs in enumerate(rcomm.all_gather(got)):
            if self._agreed_saves.get(step) == save:
                parts = self._holders_of.setdefault(step, {})
                for src in srcs:
                    parts[src] = sorted({*parts.get(src, []), holder})
        missing = [r for r in range(self.world_size) if self.holders[r]
                   and not self._holders_of.get(step, {}).get(r)]
        if missing:
            log.warning("local step %d: no replica of the parts of ranks %s (they are held once)",
                        step, missing)

    def _wanted(self, owner: int, save: str | None, into: StepStore
                ) -> Callable[[Manifest], str | None]:
        """Why a received manifest is not the copy wanted: rank ``owner``'s part, save ``save``,
        to be committed into ``into`` (where another root's step is never replaced)."""
        def check(m: Manifest) -> str | None:
            try:
                got = self._check_owner(m, owner).get("save")
            except CorruptCheckpointError as e:
                return str(e)
            other = self._classify(into, m.step)
            if other is not None:
                return (f"{into.url} holds another durable root's ({other}) step {m.step}; it is "
                        "left alone")
            if getattr(m, "shared", ()):  # files outside the step directory are not sent
                return f"step {m.step} references shared chunks; a replica holds no such files"
            return None if got == save else f"it is another save of step {m.step} ({got})"
        return check

    def wait_replicas(self) -> None:
        """Wait for the replica transfer in flight (join, close and every local save do)."""
        if self._replicator is not None:
            self._replicator.wait()

    def _write(self, step: int, flat: Mapping[str, Any], metrics: Mapping[str, float],
               metadata: Mapping[str, Any], trusted: bool, num_threads: int | None,
               save: str) -> int:
        assert self.store is not None
        try:
            local, layout = local_view(flat)
        except TypeError as e:
            if not self._warned:
                self._warned = True
                log.warning("the local tier cannot hold this state (%s): only the durable tier "
                            "saves it", e)
            raise
        info = {"rank": self.rank, "world_size": self.world_size, "dtensors": layout,
                "save": save, **({} if self.durable_key is None else {"root": self.durable_key})}
        if self.lease is not None:
            self.lease.check()
        if step not in self._saves and step not in self._bad:
            # Not a step this rank wrote: another root's step that came after the last
            # agreement is never written over (the agreed skip above covers the ones known).
            other = self._classify(self.store, step)
            if other is not None:
                self._foreign[step] = other
                raise CkptmgrError(f"{self.root} holds another durable root's ({other}) local "
                                   f"step {step}; it is left alone")
        self._saves.pop(step, None)  # from here on this rank may hold neither version whole
        self._read_failed.pop(step, None)
        plan: CommitPlan | None = self.store.begin_save(
            step, forced=False, overwrite=True, world_size=1, metrics=metrics,
            metadata={**metadata, LAYOUT_KEY: info}, on_exists="skip")
        if plan is None:
            raise CkptmgrError(f"{self.root} holds a foreign directory for step {step}")
        with torch.no_grad():
            outcome = write_step(local, self.store, plan, rank=0, group=None,
                                 planner=self._planners.get(False), trusted=trusted,
                                 num_threads=num_threads,
                                 fence=self.lease.check if self.lease is not None else None)
        self._saves[step] = save
        if not plan.staged:
            self.store.remove_replaced_attempts(plan)
        self._bad.discard(step)  # re-saved: whole again once every rank holds this save
        return outcome.bytes_written

    def _agree_and_prune(self, comm: Comm) -> None:
        """(collective) Agree on the whole steps; then delete every other step of this rank:
        those beyond the ``max_to_keep`` newest whole ones (a newer step committed on every
        rank) and those that are not whole (not restorable from this tier).

        Never deleted, besides the whole steps kept: a step owed to the durable tier (this
        rank's :attr:`owed`) whose own copy here is not known to be damaged; and, on every rank
        alike, a step some rank reports owed whose own copies each verified or could not be
        read (an I/O error, not a finding: :func:`_in_doubt`), at least one not, with its
        replicas: also when it is whole by a replica of the part a rank could not read (its
        durable copy reads own copies only). Such a step is kept until its copy is made (then
        it is owed no more) or a rank finds its part damaged, missing or another save; a read
        error alone never loses the only copy of a checkpoint. Its upload reads every byte
        again (a read that fails again fails the upload, and the step stays owed)."""
        mine: list[int] = []
        unread: list[int] = []  # steps whose manifest this rank cannot read now (left alone)
        listed = self.store is not None
        if self.store is not None:
            try:
                committed = self.store.scan().committed
                # Another root's steps are not this tier's: gone ones (removed by hand) are
                # forgotten; new ones (moved in), and the ones whose manifest could not be read,
                # are found by their manifest.
                self._foreign = {s: r for s, r in self._foreign.items() if s in committed}
                for s in committed:
                    if self._foreign.get(s) == _UNREAD or (
                            s not in self._foreign and s not in self._saves
                            and s not in self._bad):
                        other = self._classify(self.store, s)
                        if other is not None:
                            self._foreign[s] = other
                        else:
                            self._foreign.pop(s, None)
                        if other not in (None, _UNREAD):  # another root's, read now: not ours
                            self._bad.discard(s)
                            self._read_failed.pop(s, None)
                mine = [s for s in committed if s not in self._foreign]
                unread = [s for s in committed if self._foreign.get(s) == _UNREAD]
            except StorageError as e:
                listed = False
                log.warning("local tier %s: listing failed: %s", self.root, e)
        for s in [s for s in mine if s not in self._saves and s not in self._bad]:
            self._bad.add(s)  # committed here, but by no save this rank knows: not trusted
        held = [_Held(s, s not in self._bad, self._read_failed[s] if s in self._read_failed
                      else self._saves.get(s), unread=s in self._read_failed) for s in mine]
        held += [self._unread_own(s) for s in unread]
        reps: dict[int, list[int]] = {}
        foreign_reps: dict[tuple[int, int], str] = {}
        for src in self._replica_sources() if self.replicas else ():
            store = self._rep_store(src)
            try:
                held_reps = store.scan().committed
            except StorageError as e:
                listed = False
                foreign_reps.update((k, r) for k, r in self._foreign_reps.items() if k[0] == src)
                log.warning("local tier %s: listing the replicas of rank %d failed: %s",
                            self.root, src, e)
                continue
            # As for this rank's own steps: another root's replicas removed by hand are
            # forgotten (the place is free for this run's), new ones (moved in) and the ones
            # whose manifest could not be read are found by their manifest (never pruned).
            for s in held_reps:
                other = self._foreign_reps.get((src, s))
                if other == _UNREAD or (other is None and (src, s) not in self._rep_saves):
                    other = self._classify(store, s)
                if other is not None:
                    foreign_reps[(src, s)] = other
            reps[src] = [s for s in held_reps if (src, s) not in foreign_reps]
        self._foreign_reps = foreign_reps
        rep_held = [(src, _Held(s, (src, s) in self._rep_saves, self._rep_saves.get((src, s))))
                    for src, steps in reps.items() for s in steps]
        # ``owed`` changes on the uploader's thread: a copy (atomic under the GIL).
        gathered = comm.all_gather(((held, rep_held), listed, sorted(self._foreign),
                                    sorted(self.owed.copy())))
        whole, holders_of = _whole([g[0] for g in gathered], comm.world_size, self._void)
        self._collide = {s for g in gathered for s in g[2]}
        # Kept on every rank alike (from the reports, never one rank's view): owed on some
        # rank, and not whole only because a rank could not read its part.
        self._doubt = _in_doubt([g[0] for g in gathered], comm.world_size, whole)
        owed_any = {s for g in gathered for s in g[3]}
        # Whole or not: a step whole only by a replica of the part a rank could not read stays
        # in doubt for its durable copy (an upload reads own copies only), so that rank's own
        # copy and the replicas stay while it is owed, also once the step leaves the listing.
        kept = {s: v for s, v in _in_doubt([g[0] for g in gathered], comm.world_size,
                                           {}).items() if s in owed_any}
        for s in sorted(kept):  # said by the ranks that could not read (their disk)
            unread = [r for r, g in enumerate(gathered) if any(
                h.step == s and h.unread for h in g[0][0])]
            if self.rank in unread:
                log.warning("local tier %s: step %d is owed to the durable tier and rank(s) %s "
                            "could not read its part (an I/O error): kept on every rank until "
                            "its durable copy is made; check the disk", self.root, s, unread)
        self.steps = sorted(whole)[-self.max_to_keep:]
        # A whole step retention drops is never listed again unless re-saved (alike on every
        # rank: ``whole`` is agreed), even while its files stay: a step owed to the durable tier
        # is kept on disk for its upload, and must not come back as one of the newest whole
        # steps at the next agreement, when it depends on the upload's timing whether it is
        # still there, nor after a restart (recorded on disk first, before any deletion).
        gone = {s: v for s, v in whole.items() if s not in self.steps}
        self._drop(gone, record=False)  # recorded below for the ones whose files stay
        self._void.update(gone)
        self._agreed_saves = {s: whole[s] for s in self.steps}
        self._holders_of = {s: holders_of[s] for s in self.steps}
        self._borrowed = {s: m for s, m in self._borrowed.items() if s in self.steps}
        if self.store is None or self._read_only:
            return
        if not all(g[1] for g in gathered):
            # A rank that could not list reports nothing: that says nothing about its steps,
            # so no rank deletes one on its word (the next save's agreement tries again).
            log.warning("local tier %s: a rank could not list its local steps; local retention "
                        "waits for the next save", self.root)
            self._drop(gone)
            return
        # The dropped steps kept for their copy are recorded before any deletion: a crash
        # from here on never lists them again.
        self._drop({s: v for s, v in gone.items() if s in self.owed and s not in self._bad})
        for s in mine:  # every removal goes through the store's fenced door
            if s in self.owed and s not in self._bad:
                continue  # the durable tier is still owed its copy (ckptmgr.uploader)
            if s in kept:
                continue  # owed, and no part of it is known to be bad: a read may work later
            if s in self.steps and s not in self._bad and self._saves.get(
                    s, "-") == self._agreed_saves[s]:
                continue  # (a copy of another save of a whole step is deleted: not restorable)
            try:
                self.store.delete_step(s)
                self._bad.discard(s)
                self._saves.pop(s, None)
                self._read_failed.pop(s, None)
                log.info("local retention deleted step %d from %s", s, self.root)
            except LeaseError as e:
                log.error("local tier %s: retention stopped: %s", self.root, e)
                return
            except CkptmgrError as e:  # best effort: the kept steps are whole everywhere
                log.warning("local retention could not delete step %d: %s", s, e)
                if s in gone:  # its files may stay: never listed again
                    self._drop({s: gone[s]})
        try:
            self.store.remove_leftovers(self.store.scan())
        except CkptmgrError as e:
            log.warning("local tier %s: could not remove leftovers: %s", self.root, e)
        self._prune_replicas(reps, kept)

    def _prune_replicas(self, reps: dict[int, list[int]], kept: Mapping[int, str | None]
                        ) -> None:
        """Delete the replicas held here that are not a verified copy of a kept whole step's
        agreed save (with their step, by retention, or another save), and crashed transfers.
        The replicas of ``kept`` steps (owed, in doubt) stay while they do."""
        for src, steps in reps.items():
            store = self._rep_store(src)
            for s in steps:
                if s in self.steps and self._rep_saves.get((src, s), "-") == self._agreed_saves[s]:
                    continue
                if s in kept:
                    continue
                try:
                    store.delete_step(s)
                    self._rep_saves.pop((src, s), None)
                    log.info("local retention deleted the replica of rank %d's step %d from %s",
                             src, s, store.url)
                except LeaseError as e:
                    log.error("local tier %s: retention stopped: %s", self.root, e)
                    return
                except CkptmgrError as e:
                    log.warning("local retention could not delete a replica of step %d: %s",
                                s, e)
            try:
                store.remove_leftovers(store.scan())
            except CkptmgrError as e:
                log.warning("local tier %s: could not remove leftovers: %s", store.url, e)

    def forget(self, step: int) -> None:
        """(every rank alike) ``step`` is no longer whole here: not listed, not restored, and
        deleted at the next local save's agreement."""
        self._bad.add(step)
        self._read_failed.pop(step, None)  # known not to be kept: not in doubt (_in_doubt)
        self._void.add(step)
        if step in self._agreed_saves:  # nor after a restart, while its files stay
            self._drop({step: self._agreed_saves[step]})
        self.steps = [s for s in self.steps if s != step]
        self._agreed_saves.pop(step, None)

    # --------------------------------------------------------------------------- reading

    def restore(self, step: int, state_dict: Mapping[str, Any], comm: Comm, *,
                allow_partial: bool, trusted: bool, verify: bool,
                fallback: bool = True) -> int | None:
        """(collective) Restore ``step`` from the local tier if every rank can (the bytes read
        on this rank), else nothing (None; :attr:`last_failure` then says why, alike on every
        rank).

        Every rank first checks, without reading data, that its files are there with their sizes,
        that it holds the save the ranks agreed on, and that the target's DTensors have the
        saved chunks; without a ``fallback`` (the durable tier lacks the step) it also verifies
        every checksum first, so that a damaged step never reaches the target. The ranks agree;
        only then does each read its own files (checksums verified while reading) and the ranks
        agree again. Returns None (on every rank) when any rank could not: the caller restores
        the durable tier, which overwrites whatever was read, so the state never mixes the tiers.
        """
        self.last_failure = None
        self.last_target = None
        self.wait_replicas()
        if step not in self.steps:
            return None
        why, verified, io = self._fetch(step, comm, verify_bytes=not fallback) if (
            self.replicas) else (None, False, False)
        target: str | None = None
        if why is None:
            why, io, target = self._readable(step, state_dict,
                                             verify_bytes=not (fallback or verified))
        if not self._agreed(comm, why, step, "before reading", io=io, target=target):
            return None
        err: str | None = None
        nbytes = 0
        try:
            nbytes = self._load(step, state_dict, allow_partial=allow_partial, trusted=trusted,
                                verify=verify)
        except Exception as e:  # any rank's failure must reach the agreement, not hang it
            err, io, target = f"{type(e).__name__}: {e}", is_read_failure(e), _target_kind(e)
        if not self._agreed(comm, err, step, "while reading", io=io, target=target):
            return None
        log.info("restored step %d from the local tier %s (%d bytes read on this rank)", step,
                 self.root, nbytes)
        return nbytes

    def _fetch(self, step: int, comm: Comm, *, verify_bytes: bool
               ) -> tuple[str | None, bool, bool]:
        """(collective) Every rank lacking a valid copy of its own part of ``step`` (absent,
        another save, sizes or, with ``verify_bytes``, checksums) receives one from a holder of a
        replica, checked, into its own directory (healed). Why this rank could not (or None),
        whether this rank's copy had every checksum verified here, and whether this rank's
        failure is only a read of its own copy that failed (an I/O error, not a finding: no
        copy came to replace it), which never makes the step bad (:meth:`_agreed`)."""
        assert self.store is not None
        agreed = self._agreed_saves.get(step)
        own = (self._own_files_ok(step, agreed, verify_bytes)
               if step not in self._bad and self._saves.get(step, "-") == agreed else _DAMAGED)
        needy = [r for r, ok in enumerate(comm.all_gather(own == _OK)) if not ok]
        if not needy:
            return None, verify_bytes, False
        io = own == _IO_ERROR
        # Each needy rank tries its part's holders in order (alike on every rank): a holder
        # whose copy went bad since the agreement is followed by the next one.
        parts = self._holders_of.get(step, {})
        left = {r: list(parts.get(r, [])) for r in needy}
        why: str | None = "no verified copy of this rank's part is held by any rank"
        while any(left.values()):
            source = {r: hs.pop(0) for r, hs in left.items() if hs}
            sends = [(r, Sender(self._rep_store(r), step)) for r, h in source.items()
                     if h == self.rank]
            receiver = Receiver(self.store, step, self._wanted(
                self.rank, agreed, self.store)) if self.rank in source else None
            try:
                exchange(comm.group, sends, [] if receiver is None else [
                    (source[self.rank], receiver)])
            except Exception as e:  # the agreement after this says so on every rank
                return (f"fetching step {step} from its holders failed: {type(e).__name__}: {e}",
                        False, io)
            if receiver is not None and receiver.error is not None:
                why = f"its copy from rank {source[self.rank]} was refused: {receiver.error}"
            elif receiver is not None:
                why = None
                self._saves[step] = agreed
                self._bad.discard(step)
                self._read_failed.pop(step, None)
                self._borrowed.pop(step, None)
                log.info("local tier %s: step %d of this rank received from rank %d (%d bytes)",
                         self.root, step, source[self.rank], receiver.bytes)
            done = comm.all_gather(receiver is not None and receiver.error is None)
            left = {r: hs for r, hs in left.items() if not done[r]}
        if self.rank not in needy:
            return None, verify_bytes, False
        if why is not None and io:
            why = f"a read of its files failed (an I/O error), and {why}"
        # A received copy had every checksum checked as it arrived.
        return why, why is None, why is not None and io

    def _own_files_ok(self, step: int, agreed: str | None, verify_bytes: bool) -> str:
        """How this rank's own copy of ``step`` checks as the agreed save with every file's size
        (and with ``verify_bytes`` its checksum) as in its manifest: ``_OK``, ``_DAMAGED`` (a
        finding, or another save) or ``_IO_ERROR`` (a read failed: nothing is known)."""
        assert self.store is not None
        if verify_bytes:
            status, save = self._check_in(self.store, step, self.rank)
            return _DAMAGED if status == _OK and save != agreed else status
        try:
            m = self.store.read_manifest(step)
            save = self._check_owner(m).get("save")
            files = self.store.storage.list_files(step_dir_name(step))
        except (CkptmgrError, StorageError) as e:
            return _IO_ERROR if is_read_failure(e) else _DAMAGED
        return _OK if save == agreed and all(files.get(e.path) == e.size for e in m.files) else (
            _DAMAGED)

    def unreadable(self, step: int, available: list[int]) -> RestoreError:
        """The error of a step held only by this tier whose :meth:`restore` fell back (every
        rank alike: :attr:`last_failure` says why): :class:`StateMismatchError` (or
        :class:`UnsafeCheckpointError`) when every failure was about the target state (the step
        is kept), else :class:`CorruptCheckpointError`."""
        if self.last_target is not None:
            where = (f"step {step} is held only by the local tier ({self.root} on each rank) "
                     f"and cannot be restored into the given state: {self.last_failure}. The "
                     "step is kept. ")
            if self.last_target == "unsafe":
                return UnsafeCheckpointError(where + "Pass trusted=True if you trust it",
                                             step=step)
            return StateMismatchError(
                where + "Give a state with its keys, shapes and dtypes (and each DTensor "
                "sharded as when it was saved, until its durable copy is made), or "
                f"allow_partial=True, or restore another step: {available}", step=step)
        return CorruptCheckpointError(
            f"step {step} is held only by the local tier ({self.root} on each rank) and cannot "
            f"be read there: {self.last_failure}. " + (
                "Part of the target state may hold its bytes; " if self.last_failure_touched
                else "The target state was not changed; ") + f"restore another step: {available}",
            step=step)

    def _agreed(self, comm: Comm, why: str | None, step: int, when: str, *,
                io: bool = False, target: str | None = None) -> bool:
        """(collective) Whether every rank could (``why`` None here); if not, ``step`` is
        whole no more on every rank (not listed or restored from this tier unless saved again).
        ``io``: this rank's failure was a read that failed (an I/O error), not a finding. When
        every failure was one, nothing is known to be wrong with any part: the ranks that could
        not read keep theirs as unread and the others as good, so an owed step stays on every
        rank (:meth:`_agree_and_prune`); else every rank's copy goes at the next local save.
        ``target``: this rank's failure was about the target state (:func:`_target_kind`), not
        the step: when every failure was one, the step stays listed and kept on every rank
        (:attr:`last_target`)."""
        whys = comm.all_gather((why, io, target))
        bad = {r: w for r, (w, _, _) in enumerate(whys) if w is not None}
        if not bad:
            return True
        self.last_failure = "; ".join(f"rank {r}: {w}" for r, w in sorted(bad.items()))
        self.last_failure_touched = when == "while reading"
        kinds = [t for w, _, t in whys if w is not None]
        if all(kinds):
            self.last_target = "unsafe" if "unsafe" in kinds else "mismatch"
            log.warning("step %d cannot be restored from the local tier into the given state "
                        "(%s: %s); the step is kept", step, when, self.last_failure)
            return False
        whys = [(w, i, t) for w, i, t in whys if t is None]  # the step is judged by the others
        if target is not None:
            why = None  # this rank's copy is not in question
        log.warning("step %d cannot be restored from the local tier (%s: %s); every rank "
                    "restores the durable tier instead", step, when,
                    "; ".join(f"rank {r}: {w}" for r, w in sorted(bad.items())))
        self.steps = [s for s in self.steps if s != step]
        self._void.add(step)  # on every rank: it never becomes whole again unless re-saved
        if not all(failed_io for w, failed_io, _ in whys if w is not None):
            self._bad.add(step)  # a finding on some rank: deleted everywhere, as it always was
            self._read_failed.pop(step, None)
        elif why is not None:
            self._bad.add(step)
            self._read_failed[step] = self._agreed_saves.get(step)
        return False

    def _readable(self, step: int, state_dict: Mapping[str, Any], *,
                  verify_bytes: bool) -> tuple[str | None, bool, str | None]:
        """Why this rank cannot read ``step`` from its local tier, or None (reads no data unless
        ``verify_bytes``); whether that is a read that failed (an I/O error); and whether it is
        the target state that does not fit (:func:`_target_kind`; the step is not in question:
        a DTensor sharded otherwise than when it was saved, a state the tier cannot hold)."""
        assert self.store is not None
        try:
            m = self.store.read_manifest(step)
            info = self._check_owner(m)
            save = info.get("save")
            if (save if isinstance(save, str) else None) != self._agreed_saves.get(step):
                return "it holds another save of this step than the ranks agreed on", False, None
            status = self._verifies(step)[0] if verify_bytes else _OK
            if status == _IO_ERROR:
                return "a read of its files failed (an I/O error)", True, None
            if status != _OK:
                return "its files do not match their sizes and checksums", False, None
            files = self.store.storage.list_files(step_dir_name(step))
            for entry in m.files:
                if files.get(entry.path) != entry.size:
                    return f"{entry.path} is missing or has another size", False, None
            saved = info.get("dtensors", {})
        except (CkptmgrError, StorageError, TypeError) as e:
            return f"{type(e).__name__}: {e}", is_read_failure(e), None
        try:
            _, layout = local_view(flatten_state(state_dict).flat)
        except (CkptmgrError, TypeError) as e:
            return f"{type(e).__name__}: {e}", False, _target_kind(e) or "mismatch"
        for key in sorted(set(layout) | set(saved)):
            if key in layout and key in saved and layout[key] != saved[key]:
                return f"{key} is sharded differently than when it was saved", False, "mismatch"
        return None, False, None

    def _load(self, step: int, state_dict: Mapping[str, Any], *, allow_partial: bool,
              trusted: bool, verify: bool) -> int:
        assert self.store is not None
        store = self.store
        source = read_restore_source(store, step, verify=verify)
        prime_unprimed_optimizers(state_dict, source.metadata)  # before flattening the state
        with torch.no_grad():
            fs = flatten_state(state_dict, saved=source.metadata.state_dict_metadata.keys())
            view, _ = local_view(fs.flat)
            prepared = prepare_restore(source, step, view, planner="dcp",
                                       allow_partial=allow_partial, trusted=trusted,
                                       world_size=1)
            nbytes = load_step(prepared, store, step, rank=0, world_size=1, group=None,
                               verify=verify, trusted=trusted)
        tensors = set(fs.tensor_keys())
        fs.apply_values({k: view[k] for k in prepared.keys if k not in tensors})
        return nbytes

    # ----------------------------------------------------------------------- introspection

    def step_info(self, step: int) -> StepInfo:
        """This rank's manifest of local ``step`` as a StepInfo (``tiers=("local",)``): its files
        and bytes are this rank's; ``world_size`` is the job's."""
        assert self.store is not None
        m = self._borrowed.get(step) or self.store.read_manifest(step)
        info = StepInfo.from_manifest(m)
        meta = {k: v for k, v in m.metadata.items() if k not in (LAYOUT_KEY, UPLOAD_KEY)}
        layout = m.metadata.get(LAYOUT_KEY) or {}
        return replace(info, metadata=meta, world_size=int(layout.get("world_size", 1)),
                       bytes_per_rank={int(layout.get("rank", self.rank)): info.total_bytes},
                       tiers=("local",))

    @property
    def transferring(self) -> bool:
        """Whether a replica transfer runs now."""
        return self._replicator is not None and self._replicator.in_flight

    def end_transfers(self) -> None:
        """Wait for the replica transfer in flight, then destroy its group (no transfer after)."""
        if self._replicator is not None:
            self._replicator.close()
            self._replicator = None

    def close(self) -> None:
        """Wait for the replica transfer in flight, then release its group and this rank's
        local writer lease."""
        self.end_transfers()
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def upload_candidates(self) -> list[int]:
        """(ckptmgr.uploader, at construction) The whole steps, listed or not: an older whole
        step is no longer listed, but its durable copy may still be owed; and the steps not
        whole only because some rank could not read its part (an I/O error): their copy reads
        every byte again."""
        return sorted({*self._agreed_saves, *self._doubt})

    def upload_source(self, step: int, *, agreed: bool = False) -> tuple[Any, str]:
        """(ckptmgr.uploader) This rank's own committed ``step`` as its durable copy is made
        from it: the manifest and metadata (read, checked, and this rank's of this world size),
        with the listed file sizes, and the directory of its files. Reads no data.

        Args:
            step: the step.
            agreed: also require a verified copy of the save every rank agreed on for whole
                ``step`` (a node back with a stale directory holds its own copy of another save
                of it; a damaged copy is healed by a restore, not uploaded).

        Raises:
            CheckpointNotFoundError, CorruptCheckpointError: absent, or not this rank's part
                (or, with ``agreed``, another save).
        """
        assert self.store is not None
        source = read_restore_source(self.store, step, verify=True)
        save = self._check_owner(source.manifest).get("save")
        want = self._agreed_saves[step] if step in self._agreed_saves else self._doubt.get(
            step, "-")
        # A copy this rank could not read (an I/O error) of a step in doubt: its manifest
        # (read now) names the save; the upload checks every byte as it reads them.
        if agreed and (save != want if step in self._read_failed else (
                step in self._bad or self._saves.get(step, "-") != want)):
            raise CorruptCheckpointError(
                f"this rank's own copy of local step {step} ({save}) is damaged or another save "
                f"than the one every rank agreed on ({want})", step=step)
        return source, os.path.join(self.root, step_dir_name(step))


def _save_order(save: str | None) -> tuple[int, int, str]:
    """Orders save ids ``<clock>.<token>-<count>`` by time, then count (an id without a clock,
    or None, sorts first; ties by id, alike on every rank)."""
    head, _, count = (save or "").rpartition("-")
    clock, dot, _ = head.partition(".")
    try:
        return (int(clock, 16) if dot else 0, int(count), save or "")
    except ValueError:
        return (0, 0, save or "")


def _target_kind(e: BaseException) -> str | None:
    """Whether a restore's failure ``e`` is about the target state, not the step read: a state
    that does not match it (missing keys, shapes, dtypes), one the local tier cannot hold (a
    TypeError), or pickled values without ``trusted=True``: "unsafe" or "mismatch"; None
    otherwise (the step is in question)."""
    if isinstance(e, UnsafeCheckpointError):
        return "unsafe"
    return "mismatch" if isinstance(e, (StateMismatchError, TypeError)) else None


def is_read_failure(e: BaseException) -> bool:
    """Whether ``e`` says that a read failed (an I/O error other than a missing file, or an
    error caused by one), not what was read: a size or checksum mismatch, a missing file, a
    manifest that does not decode are findings."""
    if isinstance(e, (CorruptCheckpointError, UnsafeCheckpointError, CheckpointNotFoundError)):
        return False
    cause = e if isinstance(e, OSError) else e.__cause__
    return isinstance(cause, OSError) and not is_not_found(cause)


def _in_doubt(reports: list[_Report], world_size: int, whole: Mapping[int, str | None]
              ) -> dict[int, str | None]:
    """Steps not ``whole`` only because some rank could not read its own part (an I/O error,
    :attr:`_Held.unread`): every rank holds its own copy, each verified or unread, all of one
    save (an unread copy whose manifest was not read matches any), at least one unread;
    step -> that save. Own copies only: a durable copy reads each rank's own part."""
    own: dict[int, list[_Held]] = {}
    for held, _ in reports:
        for h in held:
            own.setdefault(h.step, []).append(h)
    out: dict[int, str | None] = {}
    for s, hs in sorted(own.items()):
        if (s in whole or len(hs) != world_size or not any(h.unread for h in hs)
                or not all(h.ok or h.unread for h in hs)):
            continue
        saves = {h.save for h in hs if h.ok or h.save is not None}
        if len(saves) != 1:
            continue
        (save,) = saves
        if save is not None or world_size == 1:  # as in _whole
            out[s] = save
    return out


def _whole(reports: list[_Report], world_size: int, void: set[int] | frozenset[int] = frozenset()
           ) -> tuple[dict[int, str | None], dict[int, dict[int, list[int]]]]:
    """Steps of which every rank's part is held at least once, verified (by the rank itself or
    a replica holder), all from one and the same save: step -> that save id; and for each such
    step, each part's holders other than its rank. ``void`` steps are never whole."""
    # step -> save -> part (source rank) -> ranks holding a verified copy
    copies: dict[int, dict[str | None, dict[int, set[int]]]] = {}
    for rank, (own, reps) in enumerate(reports):
        for src, h in [*((rank, h) for h in own), *reps]:
            if h.ok and h.step not in void:
                copies.setdefault(h.step, {}).setdefault(h.save, {}).setdefault(
                    src, set()).add(rank)
    whole: dict[int, str | None] = {}
    holders: dict[int, dict[int, list[int]]] = {}
    for s in sorted(copies):
        # A step written before save ids existed (None everywhere) cannot show that every rank
        # holds the same save of it: whole only where one rank is all there is.
        full = [save for save, parts in copies[s].items()
                if len(parts) == world_size and (world_size == 1 or save is not None)]
        if not full:
            continue
        # Two saves whole at once (a node back with a stale directory holding an older save of
        # the step and replicas of it): the newer one.
        save = max(full, key=_save_order)
        whole[s] = save
        holders[s] = {r: sorted(c - {r}) for r, c in copies[s][save].items()}
    return whole, holders
