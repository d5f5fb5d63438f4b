"""``CheckpointManager``: the step-indexed API over our DCP core; the only module wiring the others.

Collective calls (every rank of the group, same order): the constructor, ``save``, ``save_async``,
``restore``, ``join``, ``close``. Everything else is local and reads the view of committed steps
the ranks agreed on at construction and after each commit (the coordinator lists, then broadcasts).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    Metadata,
)

from ckptmgr._async import SaveQueue, Stager
from ckptmgr._dist import Comm, make_group
from ckptmgr._values import is_representable
from ckptmgr.config import ManagerConfig, load_config
from ckptmgr.dcp._bytes import checksum
from ckptmgr.dcp._compat import dcp_load, dcp_save
from ckptmgr.dcp._metadata_json import MAX_METADATA_BYTES, ItemLocation, decode_metadata
from ckptmgr.dcp.planner import CkptLoadPlanner, CkptSavePlanner
from ckptmgr.dcp.reader import CkptStorageReader
from ckptmgr.dcp.report import compatibility_report, describe_mesh
from ckptmgr.dcp.spmd import SpmdLoadPlanner, SpmdSavePlanner, has_sharded
from ckptmgr.dcp.state import FlatState, flatten_state
from ckptmgr.dcp.writer import CkptStorageWriter, CommitPlan
from ckptmgr.dcp.xla import wrap_xla_tensors
from ckptmgr.errors import (
    AsyncSaveError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptmgrError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    RestoreError,
    SaveError,
    StateMismatchError,
    StorageError,
    UnsafeCheckpointError,
)
from ckptmgr.info import SaveStats, StepInfo
from ckptmgr.layout import (
    MANIFEST_NAME,
    join,
    new_attempt_id,
    parse_staging_name,
    parse_step_name,
    staging_dir_name,
    step_dir_name,
)
from ckptmgr.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestError,
    UnsafePathError,
    decode_manifest,
)
from ckptmgr.policy import StepRecord, best_step, build_policy, steps_to_delete
from ckptmgr.preemption import PreemptionWatcher
from ckptmgr.storage import Storage, is_not_found, open_storage

__all__ = ["CheckpointManager"]

log = logging.getLogger("ckptmgr")


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise ConfigError(f"step must be an int >= 0, got {step!r} ({type(step).__name__})")
    if step < 0:
        raise ConfigError(f"step must be an int >= 0, got {step}")
    return int(step)


def _check_metrics(metrics: Any) -> dict[str, float]:
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"metrics must be a dict of str -> number, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise ConfigError(f"metrics keys must be str, got {k!r}")
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"metrics[{k!r}] must be a number, got {v!r}")
        out[k] = float(v)
    return out


def _check_metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise ConfigError("metadata must be a dict with str keys of JSON values")
    try:
        json.dumps(dict(metadata), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"metadata must be JSON-serializable (no NaN): {e}") from e
    return dict(metadata)


def _first_failure(e: CheckpointException) -> tuple[int, BaseException, dict[int, BaseException]]:
    failures: dict[int, BaseException] = {}
    for rank, f in sorted(e.failures.items()):
        exc = f[0] if isinstance(f, tuple) else f
        failures[rank] = exc
    if not failures:
        return -1, RuntimeError(str(e)), {}
    rank = min(failures)
    return rank, failures[rank], failures


class CheckpointManager:
    """Saves and restores a training state at integer steps under one root URL.

    Args:
        path: root directory or URL (local path, ``file://``, ``memory://``, ``gs://``,
            ``s3://``, any fsspec URL). Each step is a sub-directory named by its step number.
        save_interval: a step is due when ``step % save_interval == 0``.
        max_to_keep: keep at most this many newest steps (plus those other policies keep); None or
            0 keeps every step.
        max_pending_async: must be 1: one save in flight is the design.
        num_of_threads: writer threads per rank (None: chosen by ckptmgr).
        process_group: the training group (None: WORLD when torch.distributed is initialized).
        chkpt_on_preemption: take a last checkpoint when a preemption signal arrives.
        storage_options: passed to fsspec (endpoint, credentials, ...).
        keep_period, keep_time_interval, best_metric, best_mode, keep_best: further retention.
        overwrite: allow re-saving a committed step (the old one stays valid until the new commit).
        backpressure: "block" or "skip" while a save is in flight.
        verify: check sizes and checksums on restore.
        preemption_signals, preemption_grace_s, exit_on_preemption: preemption behaviour: at
            the first save/save_async call after one of these signals, every rank saves that
            same step, waits for the commit, then exits with 128 + signal (or returns, and
            ``reached_preemption(step)`` is True).
        preemption_file: a path whose appearance also means preemption.
        preemption_check: a callable returning True on preemption (e.g. a metadata-server poll).
        planner: "auto" (XLA-SPMD planners when the state holds XLA or other sharded tensors,
            else DCP-style planning), "dcp" or "xla_spmd".

    Raises:
        ConfigError: an invalid argument (names the field, value and rule), an unknown URL scheme,
            or a root that is a file.
        BackendNotInstalledError: the URL's fsspec backend is missing (says what to install).
    """

    def __init__(
        self,
        path: str,
        save_interval: int,
        max_to_keep: int | None = None,
        max_pending_async: int = 1,
        num_of_threads: int | None = None,
        process_group: Any = None,
        chkpt_on_preemption: bool = True,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_period: int | None = None,
        keep_time_interval: float | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        keep_best: int | None = None,
        overwrite: bool = False,
        backpressure: str = "block",
        verify: bool = True,
        preemption_signals: Any = (signal.SIGTERM,),
        preemption_grace_s: float = 30.0,
        exit_on_preemption: bool = True,
        preemption_file: str | None = None,
        preemption_check: Callable[[], bool] | None = None,
        planner: str = "auto",
    ) -> None:
        self._closed = True  # until fully constructed, close() has nothing to release
        cfg = ManagerConfig.from_kwargs(
            path=path, save_interval=save_interval, max_to_keep=max_to_keep,
            max_pending_async=max_pending_async, num_of_threads=num_of_threads,
            chkpt_on_preemption=chkpt_on_preemption, storage_options=storage_options,
            keep_period=keep_period, keep_time_interval=keep_time_interval,
            best_metric=best_metric, best_mode=best_mode, keep_best=keep_best,
            overwrite=overwrite, backpressure=backpressure, verify=verify,
            preemption_signals=preemption_signals, preemption_grace_s=preemption_grace_s,
            exit_on_preemption=exit_on_preemption, preemption_file=preemption_file,
            planner=planner)
        self.config = cfg
        self._storage: Storage = open_storage(cfg.path, cfg.storage.options)
        ret = cfg.retention
        self._policy = build_policy(
            max_to_keep=ret.max_to_keep, keep_period=ret.keep_period,
            keep_time_interval=ret.keep_time_interval, best_metric=ret.best_metric,
            best_mode=ret.best_mode, keep_best=ret.keep_best)
        self._needs_records = bool(ret.max_to_keep) and (
            ret.keep_time_interval is not None or ret.best_metric is not None)
        self._preempt = PreemptionWatcher(
            cfg.preemption.signals if cfg.preemption.enabled else (),
            file=cfg.preemption.file, check=preemption_check)
        self._preempted_step: int | None = None
        self._grace_warned = False
        # Two gloo groups of our own, each used by one thread only (two threads issuing
        # collectives on one group deadlock): the caller's thread, and the background writer.
        self._group = make_group(process_group)
        self._worker_group = make_group(process_group) if self._group is not None else None
        self._comm = Comm(self._group)
        self._wcomm = Comm(self._worker_group)
        self._queue = SaveQueue()
        self._stager = Stager()
        # One save planner for the manager's life, so that saves of an unchanged state reuse its
        # plans (saves never overlap: one runs at a time, on one thread).
        self._save_planner = CkptSavePlanner()
        self._spmd_save_planner: SpmdSavePlanner | None = None  # made at the first sharded save
        self._inflight_step: int | None = None
        self._records: dict[int, StepRecord] = {}
        self._last_stats: SaveStats | None = None
        self._closed = False
        try:
            self._records = self._comm.on_coordinator(self._scan_records)
        except BaseException:
            self._release_groups()
            self._preempt.uninstall()
            self._closed = True
            raise
        log.info("CheckpointManager at %s: %d committed steps", self._storage.url,
                 len(self._records))

    @classmethod
    def from_config(cls, config: ManagerConfig | str | os.PathLike[str],
                    process_group: Any = None) -> CheckpointManager:
        """A manager from a :class:`ManagerConfig` or a YAML file (``CKPTMGR_PATH`` overrides the
        path). Collective, like the constructor."""
        cfg = load_config(config)
        return cls(process_group=process_group, **cfg.to_kwargs())

    # ----------------------------------------------------------------- introspection (local)

    def __repr__(self) -> str:
        return (f"CheckpointManager({self._storage.url!r}, "
                f"save_interval={self.config.save_interval}, steps={len(self._records)})")

    @property
    def path(self) -> str:
        """The root URL, credentials redacted."""
        return self._storage.url

    @property
    def last_save_stats(self) -> SaveStats | None:
        """Figures of the last completed save on this rank (None before the first)."""
        return self._last_stats

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due by the interval (local; no I/O)."""
        step = _check_step(step)
        return bool(step % self.config.save_interval == 0) or step == self._preempted_step

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (the view agreed at construction and after each commit)."""
        return sorted(self._records)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return max(self._records) if self._records else None

    def best_step(self) -> int | None:
        """The best committed step by ``best_metric`` (None when unset or no step has it)."""
        ret = self.config.retention
        if ret.best_metric is None:
            return None
        records = self._records_for_policy()
        return best_step(records, ret.best_metric, ret.best_mode)

    def reached_preemption(self, step: int) -> bool:
        """Whether a preemption was agreed, and its checkpoint taken, at ``step`` (local)."""
        return _check_step(step) == self._preempted_step

    def step_info(self, step: int) -> StepInfo:
        """The manifest of committed ``step`` (reads it; local).

        Raises:
            CheckpointNotFoundError: ``step`` is not committed (lists the available ones).
            CorruptCheckpointError: the manifest does not parse or does not match.
        """
        step = _check_step(step)
        self._require_committed(step)
        return StepInfo.from_manifest(self._read_manifest(step))

    # ------------------------------------------------------------------------ collectives

    def save(self, step: int, state_dict: Mapping[str, Any], force: bool = False, *,
             metrics: Mapping[str, float] | None = None, metadata: Mapping[str, Any] | None = None,
             trusted: bool = False) -> bool:
        """Save ``state_dict`` at ``step`` if due (or ``force``); blocks until committed.

        Collective. Waits for a save in flight first. Returns True when it saved.

        Raises:
            ConfigError: a bad step, metrics, metadata or state dict.
            CheckpointExistsError: ``step`` is committed and ``overwrite`` is off.
            UnsafeCheckpointError: the state holds objects that need pickle and not ``trusted``.
            SaveError: the save failed on some rank (``.failures``); nothing was committed.
            AsyncSaveError: the previous background save failed (raised once).
        """
        return self._save(step, state_dict, force, metrics, metadata, trusted, background=False)

    def save_async(self, step: int, state_dict: Mapping[str, Any], force: bool = False, *,
                   metrics: Mapping[str, float] | None = None,
                   metadata: Mapping[str, Any] | None = None, trusted: bool = False) -> bool:
        """Save ``state_dict`` at ``step`` in the background if due (or ``force``).

        Collective. Captures the whole state before returning: tensors are copied into reused
        host buffers, Python values are deep-copied and every Stateful's ``state_dict()`` is
        called, so later changes never reach the checkpoint. A background worker then writes,
        commits and applies retention. With a save in flight it first waits for it
        (``backpressure="block"``) or returns False (``"skip"``; forced saves never skip).

        Returns:
            True when the step was captured and queued.

        Raises:
            AsyncSaveError: the previous background save failed (raised once, on every rank).
            The errors of :meth:`save` that concern the inputs.
        """
        return self._save(step, state_dict, force, metrics, metadata, trusted, background=True)

    def join(self) -> None:
        """Wait for the save in flight and its retention; re-raise its failure once.

        Raises:
            AsyncSaveError: the background save failed; its original error is ``__cause__``.
        """
        err = self._queue.wait()
        self._inflight_step = None
        if err is not None:
            raise self._async_error(err)

    def wait_until_finished(self) -> None:
        """Alias of :meth:`join`."""
        self.join()

    def close(self) -> None:
        """Wait for the save in flight (re-raising its failure), then release ckptmgr's process
        groups and staging memory. Idempotent. Collective."""
        if self._closed:
            return
        try:
            self.join()
        finally:
            self._closed = True
            self._stager.release()
            self._release_groups()
            self._preempt.uninstall()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def restore(self, step: int, state_dict: Mapping[str, Any], *, allow_partial: bool = False,
                trusted: bool = False) -> None:
        """Load committed ``step`` into ``state_dict`` in place (resharding as needed). Collective.

        Loads exactly the keys of ``state_dict`` (a subset of the checkpoint is fine). Tensors are
        filled in place; Python values are replaced; Stateful objects get ``load_state_dict``.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed (IncompleteCheckpointError when
                its directory exists but never committed).
            StateMismatchError: keys missing from the checkpoint (unless ``allow_partial``), shape
                or dtype mismatches, listed.
            CorruptCheckpointError: a size or checksum mismatch or unreadable metadata.
            UnsafeCheckpointError: a value needs pickle and not ``trusted``, or a path escapes.
        """
        self._check_open()
        step = _check_step(step)
        self.join()
        self._require_committed(step)
        fs, keys, manifest, metadata = self._comm.agree(
            lambda: self._prepare_restore(step, state_dict, allow_partial, trusted), token=step)
        flat = {k: fs.flat[k] for k in keys}
        planner = SpmdLoadPlanner() if self._spmd(flat) else CkptLoadPlanner()
        reader = CkptStorageReader(self._storage, step_dir_name(step), manifest, metadata,
                                   verify=self.config.verify, trusted=trusted)
        try:
            dcp_load(flat, reader, planner, self._group)
        except CheckpointException as e:
            rank, exc, _ = _first_failure(e)
            if isinstance(exc, (CkptmgrError)):
                if self._comm.world_size > 1 and rank != self._comm.rank and exc.args:
                    exc.args = (f"[rank {rank}] {exc.args[0]}", *exc.args[1:])
                raise exc from None
            raise RestoreError(f"restore of step {step} failed on rank {rank}: "
                               f"{type(exc).__name__}: {exc}", step=step) from exc
        if isinstance(planner, SpmdLoadPlanner):
            try:
                planner.write_back()
            except Exception as e:  # e.g. torch_xla refusing a shard: not a raw backend error
                raise RestoreError(f"restore of step {step}: loading the read shards onto the "
                                   f"devices failed: {type(e).__name__}: {e}", step=step) from e
        fs.apply_values(planner.values)
        log.info("restored step %d from %s (%d bytes read on this rank)", step,
                 self._storage.url, reader.bytes_read)

    # ------------------------------------------------------------------------- internals

    def _flatten(self, state_dict: Mapping[str, Any]) -> FlatState:
        """Flatten a state; XLA tensors become shard views unless the planner is "dcp"."""
        fs = flatten_state(state_dict)
        if self.config.planner == "dcp":
            if has_sharded(fs.flat):
                raise ConfigError(
                    "the state holds sharded tensors (ShardedTensor values), which planner='dcp' "
                    "cannot plan; use planner='auto' or 'xla_spmd'")
            return fs
        fs.flat = wrap_xla_tensors(fs.flat)
        return fs

    def _spmd(self, flat: Mapping[str, Any]) -> bool:
        return self.config.planner == "xla_spmd" or (
            self.config.planner == "auto" and has_sharded(flat))

    def _save_planner_for(self, flat: Mapping[str, Any]) -> CkptSavePlanner:
        if not self._spmd(flat):
            return self._save_planner
        if self._spmd_save_planner is None:
            self._spmd_save_planner = SpmdSavePlanner()
        return self._spmd_save_planner

    def _check_open(self) -> None:
        if self._closed:
            raise CkptmgrError("this CheckpointManager is closed; create a new one")

    def _release_groups(self) -> None:
        for attr in ("_group", "_worker_group"):
            group = getattr(self, attr, None)
            setattr(self, attr, None)
            if group is not None and dist.is_initialized():
                try:
                    dist.destroy_process_group(group)
                except Exception as e:  # a failed release must not mask the caller's error
                    log.debug("could not destroy ckptmgr group: %s", e)

    def _async_error(self, err: BaseException) -> AsyncSaveError:
        step = getattr(err, "step", None)
        failures = getattr(err, "failures", None) or {}
        e = AsyncSaveError(f"the background save of step {step} failed: {err}", step=step,
                           failures=failures)
        e.__cause__ = err
        return e

    def _require_committed(self, step: int) -> None:
        if self._storage.is_symlink(step_dir_name(step)):
            raise UnsafeCheckpointError(
                f"step directory {step} in {self._storage.url} is a symbolic link; ckptmgr never "
                "follows links out of the root (replace it with a real directory)", step=step)
        if step in self._records:
            return
        available = self.all_steps()
        shown = available if len(available) <= 20 else [*available[:5], "...", *available[-10:]]
        try:
            leftover = self._storage.exists(step_dir_name(step))
        except StorageError:
            leftover = False
        cls = IncompleteCheckpointError if leftover else CheckpointNotFoundError
        what = "exists but never committed" if leftover else "is not a committed checkpoint"
        raise cls(f"step {step} {what} in {self._storage.url}; available steps: {shown}",
                  step=step, available=available)

    def _read_manifest(self, step: int) -> Manifest:
        path = join(step_dir_name(step), MANIFEST_NAME)
        if self._storage.is_symlink(step_dir_name(step)):
            raise UnsafeCheckpointError(
                f"step directory {step} in {self._storage.url} is a symlink; refusing to follow it",
                step=step)
        try:
            # Sized first: an oversized manifest is refused without reading it.
            size = self._storage.size(path)
            if size > MAX_MANIFEST_BYTES:
                raise CorruptCheckpointError(
                    f"step {step}: {MANIFEST_NAME}: manifest is {size} bytes, over the "
                    f"{MAX_MANIFEST_BYTES} limit", step=step, path=MANIFEST_NAME)
            data = self._storage.read_bytes(path)
        except StorageError as e:
            if is_not_found(e):
                raise CheckpointNotFoundError(
                    f"step {step} has no manifest in {self._storage.url} (deleted meanwhile?)",
                    step=step, available=self.all_steps()) from e
            raise
        try:
            return decode_manifest(data, expected_step=step)
        except UnsafePathError as e:
            raise UnsafeCheckpointError(f"step {step}: {MANIFEST_NAME}: {e}", step=step) from e
        except ManifestError as e:
            raise CorruptCheckpointError(f"step {step}: {MANIFEST_NAME}: {e}", step=step,
                                         path=MANIFEST_NAME) from e

    def _read_metadata(self, step: int, manifest: Manifest) -> Metadata:
        name = manifest.metadata_file
        entry = manifest.file(name)
        path = join(step_dir_name(step), name)
        if self._storage.is_symlink(path):
            raise UnsafeCheckpointError(
                f"step {step}: {name} is a symbolic link; ckptmgr never follows links out of the "
                "step directory", step=step)
        try:
            # Sized first: a file larger than the manifest says (or than any metadata) is refused
            # without reading it.
            size = self._storage.size(path)
            if size != entry.size or size > MAX_METADATA_BYTES:
                raise CorruptCheckpointError(
                    f"step {step}: {name}: size is {size} bytes, the manifest says {entry.size}",
                    step=step, path=name)
            data = self._storage.read_bytes(path)
        except StorageError as e:
            if is_not_found(e):
                raise CorruptCheckpointError(f"step {step}: {name}: file is missing", step=step,
                                             path=name) from e
            raise
        if len(data) != entry.size or (self.config.verify and checksum(data) != entry.checksum):
            raise CorruptCheckpointError(
                f"step {step}: {name}: size or checksum does not match the manifest", step=step,
                path=name)
        try:
            return decode_metadata(data)
        except UnsafePathError as e:
            raise UnsafeCheckpointError(f"step {step}: {name}: {e}", step=step) from e
        except ManifestError as e:
            raise CorruptCheckpointError(f"step {step}: {name}: {e}", step=step, path=name) from e

    def _prepare_restore(self, step: int, state_dict: Mapping[str, Any], allow_partial: bool,
                         trusted: bool) -> tuple[FlatState, list[str], Manifest, Metadata]:
        import sys

        manifest = self._read_manifest(step)
        if manifest.byteorder != sys.byteorder:
            raise RestoreError(f"step {step} was written on a {manifest.byteorder}-endian host; "
                               f"this host is {sys.byteorder}-endian", step=step)
        metadata = self._read_metadata(step, manifest)
        fs = self._flatten(state_dict)
        pickle_keys = {idx.fqn for idx, loc in (metadata.storage_data or {}).items()
                       if isinstance(loc, ItemLocation) and loc.enc == "pickle"}
        report = compatibility_report(
            metadata, fs.flat, manifest.world_size, world_size=self._comm.world_size,
            saved_mesh=manifest.mesh, step=step)
        missing, keys = list(report.missing), list(report.loadable)
        pickled = [k for k in keys if k in pickle_keys and not trusted]
        if not report.compatible(allow_partial):
            raise StateMismatchError(report.error_message(allow_partial), step=step,
                                     missing=missing, mismatches=list(report.mismatches))
        log.info("restore plan: %s", report)
        if pickled:
            raise UnsafeCheckpointError(
                f"step {step} stores {pickled[:10]} with pickle; pass trusted=True only if you "
                "trust who wrote this checkpoint", step=step)
        if missing:
            log.warning("restore of step %d: %d keys not in the checkpoint left as they are: %s",
                        step, len(missing), missing[:10])
        return fs, keys, manifest, metadata

    def _scan_records(self) -> dict[int, StepRecord]:
        """(coordinator) List committed steps; read manifests only if a policy needs them."""
        records: dict[int, StepRecord] = {}
        for entry in self._storage.scan_root(MANIFEST_NAME):
            step = parse_step_name(entry.name)
            if step is None or not entry.is_dir or entry.is_symlink or not entry.has_marker:
                continue
            records[step] = StepRecord(step=step, time=0.0)
        if self._needs_records or self.config.retention.best_metric is not None:
            for step in list(records):
                records[step] = self._record_from_manifest(step)
        return records

    def _record_from_manifest(self, step: int) -> StepRecord:
        try:
            m = self._read_manifest(step)
        except CkptmgrError as e:
            # NaN: no time-based policy keeps or anchors on it; step-based ones still apply.
            log.warning("step %d: unreadable manifest (%s)", step, e)
            return StepRecord(step=step, time=float("nan"))
        return StepRecord(step=step, time=m.unix_time, metrics=dict(m.metrics))

    def _records_for_policy(self) -> list[StepRecord]:
        return [self._records[s] for s in sorted(self._records)]

    def _save(self, step: Any, state_dict: Mapping[str, Any], force: bool, metrics: Any,
              metadata: Any, trusted: bool, *, background: bool) -> bool:
        t_call = time.perf_counter()
        self._check_open()
        step = _check_step(step)
        if not isinstance(force, bool):
            raise ConfigError(f"force must be a bool, got {force!r}")
        metrics_d = _check_metrics(metrics)
        metadata_d = _check_metadata(metadata)
        signum = self._agree_preemption()
        if signum:
            return self._preemption_save(step, state_dict, metrics_d, metadata_d, trusted,
                                         signum, t_call)
        if not (force or self.should_save(step)):
            # A step that is not due never blocks. A failure already known is raised now when
            # this process is alone; with several ranks only at due steps, where all ranks meet.
            if self._comm.world_size == 1 and self._queue.has_failed():
                self.join()
            return False
        # With "skip", every rank must take the same decision: skip if a save is in flight on any.
        if (background and self.config.async_.backpressure == "skip" and not force
                and self._comm.any(self._queue.in_flight)):
            log.info("skipping step %d: the save of step %s is still in flight", step,
                     self._inflight_step)
            return False
        self.join()
        fs, plan = self._prepare(step, state_dict, metrics_d, metadata_d, trusted)
        if not background:
            self._write_and_commit(plan, fs.flat, trusted, self._comm, self._group, t_call, None)
            return True
        staged = self._stager.stage(fs.flat)
        blocking_s = time.perf_counter() - t_call
        self._inflight_step = step
        self._queue.submit(
            lambda: self._write_and_commit(plan, staged, trusted, self._wcomm, self._worker_group,
                                           t_call, blocking_s),
            name=f"ckptmgr-save-{step}")
        return True

    def _prepare_save(self, state_dict: Mapping[str, Any], trusted: bool) -> FlatState:
        fs = self._flatten(state_dict)
        if not trusted:
            bad = [k for k in fs.value_keys() if not is_representable(fs.flat[k])]
            if bad:
                kinds = sorted({type(fs.flat[k]).__name__ for k in bad})
                raise UnsafeCheckpointError(
                    f"state values {bad[:10]} ({', '.join(kinds)}) can only be stored with pickle; "
                    "store tensors and plain Python values, or pass trusted=True to save "
                    "(restoring them will need trusted=True too)")
        return fs

    def _plan_commit(self, step: int, metrics: dict[str, float],
                     metadata: dict[str, Any], mesh: Any = None) -> CommitPlan:
        """(coordinator) Decide where this attempt writes."""
        committed = step in self._records
        if committed and not self.config.overwrite:
            raise CheckpointExistsError(
                f"step {step} is already committed in {self._storage.url}; pass overwrite=True "
                "to replace it, or save another step")
        attempt = new_attempt_id()
        sdir = step_dir_name(step)
        staged = self._storage.supports_rename and not committed
        if staged:
            if self._storage.exists(sdir):
                # An uncommitted leftover of a crashed save of this very step blocks the rename.
                log.info("removing uncommitted leftover %s/%s", self._storage.url, sdir)
                self._storage.remove(sdir, recursive=True)
            write_dir = staging_dir_name(step, attempt)
        else:
            write_dir = sdir
        self._storage.makedirs(write_dir)
        return CommitPlan(step=step, attempt=attempt, write_dir=write_dir, step_dir=sdir,
                          staged=staged, overwrite=committed, world_size=self._comm.world_size,
                          metrics=metrics, metadata=metadata, mesh=mesh)

    def _agree_preemption(self) -> int:
        """(collective on the caller group) The preemption signal any rank saw, else 0."""
        local = self._preempt.triggered()
        if self._comm.world_size == 1:
            return local
        return int(max(self._comm.all_gather(local)))

    def _preemption_save(self, step: int, state_dict: Mapping[str, Any],
                         metrics: dict[str, float], metadata: dict[str, Any], trusted: bool,
                         signum: int, t_call: float) -> bool:
        """Every rank saves ``step`` now, waits for the commit, then exits (or returns True)."""
        log.warning("preemption (signal %d) agreed at step %d: saving it before exiting",
                    signum, step)
        self._preempted_step = step
        try:
            self.join()
        except AsyncSaveError as e:  # the last checkpoint matters more than the one before it
            log.error("the save before the preemption failed: %s", e)
        if step in self._records and not self.config.overwrite:
            log.warning("step %d is already committed: it is the preemption checkpoint", step)
        else:
            fs, plan = self._prepare(step, state_dict, metrics, metadata, trusted)
            self._write_and_commit(plan, fs.flat, trusted, self._comm, self._group, t_call, None)
        self._preempt.acknowledge()
        log.warning("preemption checkpoint of step %d committed in %.2f s", step,
                    time.perf_counter() - t_call)
        if self.config.preemption.exit_on_preemption:
            self.close()
            raise SystemExit(128 + signum)
        return True

    def _prepare(self, step: int, state_dict: Mapping[str, Any], metrics: dict[str, float],
                 metadata: dict[str, Any], trusted: bool) -> tuple[FlatState, CommitPlan]:
        """(caller thread, collective) Flatten and check the state; the coordinator plans."""
        fs = self._comm.agree(lambda: self._prepare_save(state_dict, trusted), token=step)
        mesh = describe_mesh(fs.flat)
        plan = self._comm.on_coordinator(lambda: self._plan_commit(step, metrics, metadata, mesh))
        return fs, plan

    def _write_and_commit(self, plan: CommitPlan, flat: dict[str, Any], trusted: bool,
                          comm: Comm, group: Any, t_call: float, blocking_s: float | None) -> None:
        """(collective over ``group``) Write, commit, apply retention, agree on the new steps.

        Runs on the caller's thread for ``save`` and on the worker thread for ``save_async``;
        ``comm``/``group`` are the ones owned by that thread.
        """
        step = plan.step
        writer = CkptStorageWriter(self._storage, plan, comm.rank, trusted=trusted,
                                   num_threads=self.config.async_.num_of_threads)
        save_planner = self._save_planner_for(flat)
        t_write = time.perf_counter()
        try:
            dcp_save(flat, writer, save_planner, group)
        except CheckpointException as e:
            rank, exc, failures = _first_failure(e)
            comm.on_coordinator(lambda: self._discard_attempt(plan))
            if isinstance(exc, UnsafeCheckpointError):
                raise exc from None
            raise SaveError(f"save of step {step} to {self._storage.url} failed on rank {rank}: "
                            f"{type(exc).__name__}: {exc}", step=step, failures=failures) from exc
        finally:
            save_planner.release_state()  # keep the plans, not the caller's tensors
        write_s = time.perf_counter() - t_write
        manifest = writer.manifest  # set on the coordinator only
        self._records = comm.on_coordinator(lambda: self._after_commit(plan, manifest))
        total = sum(comm.all_gather(writer.bytes_written))
        stats = SaveStats(
            step=step,
            blocking_s=blocking_s if blocking_s is not None else time.perf_counter() - t_call,
            write_s=write_s, bytes=writer.bytes_written, total_bytes=total)
        self._last_stats = stats
        grace = self.config.preemption.grace_s
        took = stats.blocking_s + (write_s if blocking_s is not None else 0.0)
        if self.config.preemption.enabled and took > grace and not self._grace_warned:
            self._grace_warned = True
            log.warning("saving step %d took %.1f s, longer than preemption_grace_s=%.1f s: a "
                        "preemption checkpoint may be killed before it commits; raise the grace "
                        "period of your scheduler or make the state smaller", step, took, grace)
        log.info("saved step %d to %s: blocked %.3f s, wrote %d bytes in %.3f s (%.1f MB/s)",
                 step, self._storage.url, stats.blocking_s, total, write_s,
                 stats.throughput_bytes_per_s / 1e6)

    def _discard_attempt(self, plan: CommitPlan) -> None:
        """(coordinator) Remove what a failed attempt wrote; never a committed manifest's files."""
        try:
            if plan.staged:
                self._storage.remove(plan.write_dir, recursive=True)
                return
            try:
                current = decode_manifest(self._storage.read_bytes(
                    join(plan.step_dir, MANIFEST_NAME))).attempt
            except (StorageError, ManifestError):
                current = None
            if current == plan.attempt:
                return
            for name in self._storage.list_files(plan.step_dir):
                if plan.attempt in name:
                    self._storage.remove(join(plan.step_dir, name))
        except StorageError as e:  # cleanup is best effort; the save error is what matters
            log.warning("could not remove files of failed attempt %s: %s", plan.attempt, e)

    def _after_commit(self, plan: CommitPlan, manifest: Manifest | None) -> dict[int, StepRecord]:
        """(coordinator) Record the commit, drop an overwritten attempt, apply retention."""
        assert manifest is not None, "coordinator has no manifest after commit"
        records = dict(self._records)
        records[plan.step] = StepRecord(step=plan.step, time=manifest.unix_time,
                                        metrics=dict(manifest.metrics))
        if not plan.staged:
            # Direct writes (object stores, overwrite): files of older or crashed attempts of
            # this step are not referenced by the new manifest.
            self._remove_other_attempts(plan)
        # Nothing is in flight here: the only save in flight is the one that just committed.
        to_delete = steps_to_delete([records[s] for s in sorted(records)], self._policy)
        for s in to_delete:
            if self._delete_step(s):
                del records[s]
        self._remove_leftovers(plan, max(records))
        return records

    def _remove_other_attempts(self, plan: CommitPlan) -> None:
        keep_token = plan.attempt
        try:
            for name in self._storage.list_files(plan.step_dir):
                # data/metadata of other attempts, and manifests half-written by a crash
                if name != MANIFEST_NAME and keep_token not in name and (
                        name.startswith(("data-", "metadata-", f"{MANIFEST_NAME}.tmp-"))):
                    self._storage.remove(join(plan.step_dir, name))
        except StorageError as e:
            log.warning("could not remove files replaced by overwrite of step %d: %s",
                        plan.step, e)

    def _delete_step(self, step: int) -> bool:
        """Delete a committed step: manifest first (uncommitting it), then its files."""
        sdir = step_dir_name(step)
        try:
            self._storage.remove(join(sdir, MANIFEST_NAME))
        except StorageError as e:
            log.warning("retention could not delete step %d: %s", step, e)
            return False
        try:
            self._storage.remove(sdir, recursive=True)
        except StorageError as e:
            log.warning("step %d uncommitted but its files remain: %s", step, e)
        log.info("retention deleted step %d from %s", step, self._storage.url)
        return True

    def _only_our_files(self, dirname: str) -> bool:
        """Whether every file in ``dirname`` has a name ckptmgr writes (else it is not ours)."""
        names = self._storage.list_files(dirname)
        ours = all(n.startswith(("data-", "metadata-", f"{MANIFEST_NAME}.tmp-")) for n in names)
        if not ours:
            log.warning("%s/%s has no manifest but holds files ckptmgr did not write; leaving it",
                        self._storage.url, dirname)
        return ours

    def _remove_leftovers(self, plan: CommitPlan, newest: int) -> None:
        """Remove crashed saves' leftovers that are provably ours and not in flight: staging
        directories and uncommitted step directories older than the newest committed step."""
        try:
            for entry in self._storage.scan_root(MANIFEST_NAME):
                staged = parse_staging_name(entry.name)
                step = parse_step_name(entry.name)
                old_staging = (staged is not None and staged[1] != plan.attempt
                               and staged[0] < newest)
                old_uncommitted = (step is not None and not entry.has_marker and step < newest
                                   and not entry.is_symlink and step not in self._records
                                   and self._only_our_files(entry.name))
                if not (old_staging or old_uncommitted):
                    continue
                log.info("removing leftover of a crashed save: %s/%s", self._storage.url,
                         entry.name)
                self._storage.remove(entry.name, recursive=True)
        except StorageError as e:
            log.warning("could not remove leftovers: %s", e)

