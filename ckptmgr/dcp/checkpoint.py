"""One trip down into the DCP core for a save and for a restore.

The manager hands a user's state dict here once: :func:`prepare_save` flattens it, wraps XLA
tensors, chooses the planner, describes the mesh and refuses values that need pickle (unless
trusted); :func:`write_step` runs DCP's save through our writer and turns DCP's failures into
ours. :func:`read_restore_source` reads and checks the manifest and metadata and lists the step
once; :func:`prepare_restore` flattens the target and compares it with the checkpoint;
:func:`load_step` runs DCP's load through our reader.

Call order and ranks: ``prepare_*`` run on every rank (the caller agrees on the outcome);
``read_restore_source`` on the coordinator only (the caller broadcasts its result: no other rank
lists the step or reads its manifest or metadata); ``write_step`` and ``load_step`` are collective
over the group they are given, check in with its :class:`~ckptmgr._arrivals.Arrivals` before
each of DCP's collectives, and turn a collective that fails or times out into the SaveError or
RestoreError naming the ranks that did not arrive and the phase.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from ckptmgr._arrivals import Arrivals, track
from ckptmgr.codec.layout import step_dir_name
from ckptmgr.codec.manifest import Manifest
from ckptmgr.codec.metadata import ItemLocation
from ckptmgr.codec.values import is_representable
from ckptmgr.dcp.compat import dcp_load, dcp_save
from ckptmgr.dcp.metadata import metadata_from_doc
from ckptmgr.dcp.optim import prime_optimizer
from ckptmgr.dcp.planner import CkptLoadPlanner, CkptSavePlanner
from ckptmgr.dcp.reader import CkptStorageReader
from ckptmgr.dcp.report import CompatibilityReport, compatibility_report, describe_mesh
from ckptmgr.dcp.shared_reads import plan_shared_reads, share_reads
from ckptmgr.dcp.spmd import SpmdLoadPlanner, SpmdSavePlanner, has_sharded
from ckptmgr.dcp.state import FlatState, flatten_state
from ckptmgr.dcp.writer import CkptStorageWriter
from ckptmgr.dcp.xla import wrap_xla_tensors
from ckptmgr.errors import (
    CkptmgrError,
    ConfigError,
    LeaseError,
    RestoreError,
    SaveError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from ckptmgr.step_store import CommitPlan, StepStore
from ckptmgr.storage import retry_budget

__all__ = [
    "PLANNERS",
    "PreparedRestore",
    "PreparedSave",
    "RestoreSource",
    "SavePlanners",
    "WriteOutcome",
    "empty_containers",
    "first_failure",
    "load_step",
    "prepare_restore",
    "prepare_save",
    "prime_unprimed_optimizers",
    "read_restore_source",
    "raise_load_failure",
    "write_step",
]

log = logging.getLogger("ckptmgr")

PLANNERS = ("auto", "dcp", "xla_spmd")


def raise_load_failure(e: CheckpointException, *, rank: int, world_size: int, step: int,
                       what: str) -> NoReturn:
    """Raise the error of a failed DCP load: the first failing rank's own CkptmgrError (named
    with its rank on the other ranks), else a RestoreError wrapping it."""
    failed_rank, exc, _ = first_failure(e)
    if isinstance(exc, CkptmgrError):
        if world_size > 1 and failed_rank != rank and exc.args:
            exc.args = (f"[rank {failed_rank}] {exc.args[0]}", *exc.args[1:])
        raise exc from None
    raise RestoreError(f"{what} failed on rank {failed_rank}: {type(exc).__name__}: {exc}",
                       step=step) from exc


def first_failure(e: CheckpointException) -> tuple[int, BaseException, dict[int, BaseException]]:
    """The lowest failing rank of a DCP failure, its error, and every rank's error."""
    failures: dict[int, BaseException] = {}
    for rank, f in sorted(e.failures.items()):
        failures[rank] = f[0] if isinstance(f, tuple) else f
    if not failures:
        return -1, RuntimeError(str(e)), {}
    rank = min(failures)
    return rank, failures[rank], failures


def _flatten(state_dict: Mapping[str, Any], planner: str,
             saved: Collection[str] | None = None) -> tuple[FlatState, bool]:
    """Flatten a state (XLA tensors become shard views unless ``planner="dcp"``); whether the
    SPMD planners apply. ``saved``: on restore, the step's flat keys (``flatten_state``)."""
    fs = flatten_state(state_dict, saved=saved)
    if planner == "dcp":
        if has_sharded(fs.flat):
            raise ConfigError(
                "the state holds sharded tensors (ShardedTensor values), which planner='dcp' "
                "cannot plan; use planner='auto' or 'xla_spmd'")
        return fs, False
    fs.flat = wrap_xla_tensors(fs.flat)
    return fs, planner == "xla_spmd" or has_sharded(fs.flat)


@dataclass
class PreparedSave:
    """A state ready to be written: flat values, the planner choice, the mesh description."""

    state: FlatState
    spmd: bool
    mesh: Any
    pickled: list[str] = field(default_factory=list)

    @property
    def flat(self) -> dict[str, Any]:
        return self.state.flat


def prepare_save(state_dict: Mapping[str, Any], *, planner: str, trusted: bool) -> PreparedSave:
    """Flatten and check a state for saving (every rank, caller's thread).

    Raises:
        ConfigError: a state the chosen planner cannot plan.
        UnsafeCheckpointError: values that need pickle and not ``trusted``.
    """
    fs, spmd = _flatten(state_dict, planner)
    pickled = [k for k in fs.value_keys() if not is_representable(fs.flat[k])]
    if pickled and not trusted:
        kinds = sorted({type(fs.flat[k]).__name__ for k in pickled})
        raise UnsafeCheckpointError(
            f"state values {pickled[:10]} ({', '.join(kinds)}) can only be stored with pickle; "
            "store tensors and plain Python values, or pass trusted=True to save "
            "(restoring them will need trusted=True too)")
    return PreparedSave(fs, spmd, describe_mesh(fs.flat), pickled)


class SavePlanners:
    """The save planners of one manager, kept across saves so that an unchanged state reuses its
    plans (saves never overlap: one runs at a time, on one thread)."""

    def __init__(self, *, chunk_bytes: int | None = None) -> None:
        """
        Args:
            chunk_bytes: the FSDP/DCP planner cuts tensor chunks larger than this into row
                blocks (``reuse_unchanged=True``); the SPMD planner keeps whole shards.
        """
        self._dcp = CkptSavePlanner(chunk_bytes=chunk_bytes)
        self._spmd: SpmdSavePlanner | None = None  # made at the first sharded save

    def get(self, spmd: bool) -> CkptSavePlanner:
        if not spmd:
            return self._dcp
        if self._spmd is None:
            self._spmd = SpmdSavePlanner(flatten_state_dict=False)
        return self._spmd


@dataclass(frozen=True)
class WriteOutcome:
    """What one rank's write of a step produced."""

    manifest: Manifest | None  # the coordinator's only
    bytes_written: int


def write_step(flat: dict[str, Any], store: StepStore, plan: CommitPlan, *, rank: int,
               group: Any, planner: CkptSavePlanner, trusted: bool,
               num_threads: int | None = None,
               fence: Callable[[], None] | None = None,
               arrivals: Arrivals | None = None) -> WriteOutcome:
    """(collective over ``group``) Write ``flat`` as ``plan``'s attempt and commit it.

    On failure the coordinator discards the attempt; the error is a SaveError naming the first
    failing rank (or the UnsafeCheckpointError / LeaseError that stopped it), or, for a
    collective that failed or timed out, the ranks that did not arrive (``arrivals``).
    """
    writer = CkptStorageWriter.for_attempt(store.storage, plan, rank, trusted=trusted,
                                           num_threads=num_threads, fence=fence)
    if arrivals is not None:
        arrivals.begin("save", plan.step, "write")
    # Every rank enters DCP's plan exchange after prepare_local_plan and its write exchange after
    # write_data; the coordinator's global plan and commit (finish) run inside those exchanges.
    track(writer, arrivals, {"prepare_local_plan": ("plan", "plan"),
                             "prepare_global_plan": ("", None),
                             "write_data": ("write", "commit"), "finish": ("", None)})
    # Every storage call of this save shares one retry budget, the clean-up of a failed attempt
    # too: a store gone for good fails the whole save within it (ckptmgr.storage._retry).
    with retry_budget():
        try:
            dcp_save(flat, writer, planner, group)
            if arrivals is not None:
                # what follows (retention, the new view) is the commit's
                arrivals.phase = "commit"
        except CheckpointException as e:
            failed_rank, exc, failures = first_failure(e)
            if rank == 0:
                store.discard(plan)
            if isinstance(exc, (UnsafeCheckpointError, LeaseError)):
                raise exc from None
            raise SaveError(f"save of step {plan.step} to {store.url} failed on rank "
                            f"{failed_rank}: {type(exc).__name__}: {exc}", step=plan.step,
                            failures=failures) from exc
        except Exception as e:  # a collective failed (a rank died) or timed out
            if rank == 0:
                store.discard(plan)
            if arrivals is None or isinstance(e, CkptmgrError):
                raise
            raise arrivals.error(e) from e
        finally:
            planner.release_state()  # keep the plans, not the caller's tensors
    return WriteOutcome(writer.manifest, writer.bytes_written)


def prime_unprimed_optimizers(state_dict: Mapping[str, Any], metadata: Metadata) -> None:
    """Prime every top-level optimizer object without state whose checkpoint entry has state:
    an in-place load can only fill state that exists."""
    saved = metadata.state_dict_metadata
    for key, value in state_dict.items():
        if isinstance(value, torch.optim.Optimizer) and not value.state and any(
                k.startswith(f"{key}.state.") for k in saved):
            prime_optimizer(value)


def empty_containers(value: Any, prefix: str, out: list[str], depth: int = 0) -> None:
    """Append to ``out`` the flat key of every empty mapping in ``value`` (under ``prefix``): an
    in-place load cannot fill what an empty container (an unprimed optimizer's ``state``) lacks."""
    if not isinstance(value, Mapping) or depth > 64:
        return
    if not value and prefix:
        out.append(prefix)
    for k, v in value.items():
        empty_containers(v, f"{prefix}.{k}" if prefix else str(k), out, depth + 1)


def _unfilled(state_dict: Mapping[str, Any], fs: FlatState, metadata: Metadata) -> list[str]:
    """Checkpoint entries under a container the target holds empty (an unprimed optimizer's
    ``state: {}``): an in-place load would leave them silently out."""
    empty: list[str] = []
    empty_containers(state_dict, "", empty)
    if not empty:
        return []
    prefixes = tuple(f"{p}." for p in empty)
    return sorted(k for k in metadata.state_dict_metadata
                  if k not in fs.flat and k.startswith(prefixes))


@dataclass(frozen=True)
class RestoreSource:
    """What a restore reads of a step besides its data, once, on the coordinator (picklable: the
    caller broadcasts it): the manifest, the DCP metadata, and the step directory's listing."""

    manifest: Manifest
    metadata: Metadata
    sizes: dict[str, int]  # file name -> bytes, as listed


def read_restore_source(store: StepStore, step: int, *, verify: bool) -> RestoreSource:
    """(coordinator) ``step``'s manifest and metadata, read and checked once
    (:meth:`StepStore.read_step`), with the metadata made DCP's.

    Raises:
        RestoreError: a checkpoint of the other byte order.
        CheckpointNotFoundError, CorruptCheckpointError, UnsafeCheckpointError: as
            :meth:`StepStore.read_step`, or a dtype this torch does not have.
    """
    files = store.read_step(step, verify=verify)
    return RestoreSource(files.manifest, metadata_from_doc(files.metadata, files.manifest),
                         files.sizes)


@dataclass
class PreparedRestore:
    """A checked restore: the flattened target, the keys to load, the step's manifest and
    metadata, the listed file sizes, and the comparison report."""

    state: FlatState
    keys: list[str]
    manifest: Manifest
    metadata: Metadata
    report: CompatibilityReport
    spmd: bool
    sizes: dict[str, int] | None = None


def prepare_restore(source: RestoreSource, step: int, state_dict: Mapping[str, Any], *,
                    planner: str, allow_partial: bool, trusted: bool,
                    world_size: int) -> PreparedRestore:
    """Compare ``source`` (the coordinator's :func:`read_restore_source`, broadcast) with the
    target: this rank's own compatibility check, no I/O (every rank; the caller agrees on the
    outcome).

    Raises:
        StateMismatchError: missing keys (unless ``allow_partial``), shape or dtype mismatches.
        UnsafeCheckpointError: requested values stored with pickle and not ``trusted``.
    """
    manifest, metadata = source.manifest, source.metadata
    prime_unprimed_optimizers(state_dict, metadata)
    fs, spmd = _flatten(state_dict, planner, metadata.state_dict_metadata.keys())
    # Only values can be pickled: look them up (iterating storage_data would visit every chunk).
    stored = metadata.storage_data or {}
    pickle_keys = {fqn for fqn, m in metadata.state_dict_metadata.items()
                   if isinstance(m, BytesStorageMetadata)
                   and isinstance(loc := stored.get(MetadataIndex(fqn)), ItemLocation)
                   and loc.enc == "pickle"}
    report = compatibility_report(metadata, fs.flat, manifest.world_size,
                                  world_size=world_size, saved_mesh=manifest.mesh, step=step)
    missing, keys = list(report.missing), list(report.loadable)
    if not report.compatible(allow_partial):
        raise StateMismatchError(report.error_message(allow_partial), step=step,
                                 missing=missing, mismatches=list(report.mismatches))
    unfilled = [] if allow_partial else _unfilled(state_dict, fs, metadata)
    if unfilled:
        raise StateMismatchError(
            f"step {step} holds {len(unfilled)} entries under keys you asked to restore that your "
            f"state lacks, e.g. {unfilled[:6]}: restoring would leave them silently empty. An "
            "optimizer's state dict is empty until its first step: call "
            "ckptmgr.prime_optimizer(optimizer) before restore (or pass the optimizer object, "
            "which ckptmgr primes), or pass allow_partial=True to load only what the state asks "
            "for", step=step, missing=unfilled, mismatches=[])
    log.info("restore plan: %s", report)
    pickled = [k for k in keys if k in pickle_keys and not trusted]
    if pickled:
        raise UnsafeCheckpointError(
            f"step {step} stores {pickled[:10]} with pickle; pass trusted=True only if you "
            "trust who wrote this checkpoint", step=step)
    if missing:
        log.warning("restore of step %d: %d keys not in the checkpoint left as they are: %s",
                    step, len(missing), missing[:10])
    return PreparedRestore(fs, keys, manifest, metadata, report, spmd, source.sizes)


def load_step(prepared: PreparedRestore, store: StepStore, step: int, *, rank: int,
              world_size: int, group: Any, verify: bool, trusted: bool,
              arrivals: Arrivals | None = None) -> int:
    """(collective over ``group``) Load ``prepared``'s keys in place; the bytes read here.

    Raises:
        The CkptmgrError a rank met (prefixed with its rank), or RestoreError (for a collective
        that failed or timed out: naming the ranks that did not arrive).
    """
    wanted = {k: prepared.state.flat[k] for k in prepared.keys}
    planner = SpmdLoadPlanner(flatten_state_dict=False) if prepared.spmd else CkptLoadPlanner()
    reader = CkptStorageReader.for_step(store.storage, step_dir_name(step), prepared.manifest,
                                        prepared.metadata, verify=verify, trusted=trusted)
    reader.listed = prepared.sizes  # the coordinator's listing: no rank lists the step again
    track(reader, arrivals, {"prepare_local_plan": ("restore", "restore"),
                             "prepare_global_plan": ("", None), "read_data": ("restore", None)})
    try:
        # Replicated state is read by one holder each and sent to the others (dcp.shared_reads).
        shares = {} if prepared.spmd else plan_shared_reads(
            wanted, prepared.metadata, rank=rank, world_size=world_size, group=group)
        flat = {k: v for k, v in wanted.items() if k not in shares or shares[k].reader == rank}
        with retry_budget():
            dcp_load(flat, reader, planner, group)
        share_reads(wanted, shares, rank=rank, world_size=world_size, group=group)
    except CheckpointException as e:
        raise_load_failure(e, rank=rank, world_size=world_size, step=step,
                           what=f"restore of step {step}")
    except Exception as e:  # a collective failed (a rank died) or timed out
        if arrivals is None or isinstance(e, CkptmgrError):
            raise
        raise arrivals.error(e) from e
    if isinstance(planner, SpmdLoadPlanner):
        try:
            planner.write_back()
        except Exception as e:  # e.g. torch_xla refusing a shard: not a raw backend error
            raise RestoreError(f"restore of step {step}: loading the read shards onto the "
                               f"devices failed: {type(e).__name__}: {e}", step=step) from e
    prepared.state.apply_values(planner.values)
    return reader.bytes_read

