"""``CkptmgrCheckpointIO``: Lightning's checkpoint I/O through ckptmgr (needs
``lightning``: ``pip install lightning``, or ``pip install -e ".[lightning]"`` in the clone)::

    trainer = lightning.Trainer(
        plugins=[CkptmgrCheckpointIO(max_to_keep=3)],
        callbacks=[ModelCheckpoint(dirpath="s3://bucket/run-7", every_n_train_steps=500,
                                   save_last=True)])
    trainer.fit(model, ckpt_path="last")

How Lightning's file paths map onto steps (docs/integrations.md):
- a path's directory ``DIR`` holds Lightning's ``.ckpt`` names only; the steps live in a hidden
  directory beside them, one root per run: ``DIR/.ckptmgr/RUN/`` (``RUN`` is the UTC time the
  plugin first saved into ``DIR`` plus a random suffix; its lease file, step directories and
  ``.tmp-*`` staging stay in there). The checkpoint's ``global_step`` is the step: saving
  ``DIR/epoch=0-step=500.ckpt`` saves step 500 under ``DIR/.ckptmgr/RUN/`` with ckptmgr's async
  queue, retention and checksums. ``root=URL`` puts the run roots at ``URL/RUN/`` instead, for a
  ``DIR`` that holds nothing but ``.ckpt`` files (the pointers then name ``URL``);
- a new run (a new plugin, or one used again after ``teardown``) never reuses another run's step:
  a second run into the same ``DIR`` saves its own step 500 in its own root, even while the first
  run's step 500 is there (Lightning then names the file ``...-v1.ckpt``, as with its own I/O);
- a small JSON pointer file is written at the path itself before ``save_checkpoint`` returns
  (``{"ckptmgr_step": 500, "ckptmgr_run": RUN}``), so Lightning's file checks, versioning,
  ``save_last`` and ``fit(ckpt_path="last")`` see it at once, async save or not. ``last.ckpt``
  saved at the same step, with no tensor changed in place or replaced since, points to the same
  step: nothing is written twice (its Python values, such as the callbacks' bookkeeping, are the
  first save's). Other tensors at a step this run saved (weights changed since, a weights-only
  save) start a new run root, so every earlier pointer keeps reading what it pointed to;
- loading a path reads its pointer (or, for a step directory ``DIR/.ckptmgr/RUN/500``, that
  step), waiting for this plugin's save in flight; a pointer whose step never committed loads
  what the file named before (kept in it as ``ckptmgr_prev``), with a warning; one whose step
  is not there otherwise (deleted by retention) raises ``CheckpointNotFoundError`` saying so;
- removing a path (``save_top_k``) removes the pointer only: steps are deleted by ckptmgr's
  retention (``max_to_keep`` and the other retention arguments, per run), never by Lightning;
  when retention deletes a step, the pointers this plugin wrote to it are removed too.

Single-process strategies (CPU, one GPU) only: Lightning calls the plugin's save on global rank
zero alone, while a ckptmgr save is collective over every rank.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.plugins.io import CheckpointIO

from ckptmgr.codec.layout import parse_step_name
from ckptmgr.errors import CheckpointNotFoundError, ConfigError
from ckptmgr.events import CheckpointListener
from ckptmgr.info import SaveStats
from ckptmgr.manager import CheckpointManager
from ckptmgr.storage import open_storage

__all__ = ["DATA_DIR", "POINTER_KEY", "ROOT_KEY", "RUN_KEY", "CkptmgrCheckpointIO"]

log = logging.getLogger("ckptmgr")

POINTER_KEY = "ckptmgr_step"
RUN_KEY = "ckptmgr_run"  # the run root under DATA_DIR (absent in pointers of plugin 0.1 roots)
ROOT_KEY = "ckptmgr_root"  # where the run roots are, when not DIR/DATA_DIR (the root= argument)
PREV_KEY = "ckptmgr_prev"  # what the pointer named before (read if its own step never commits)
DATA_DIR = ".ckptmgr"  # hidden beside the .ckpt files: one root per run under it
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MAX_POINTER = 4096


def _split(path: Any) -> tuple[str, str]:
    """(root, name) of a Lightning checkpoint path: the directory and the last component."""
    text = str(path).rstrip("/")
    root, sep, name = text.rpartition("/")
    if not sep or not name:
        raise ConfigError(f"checkpoint path must be ROOT/NAME, got {text!r}")
    return root or "/", name


def _flatten(value: Any, path: str, flat: dict[str, Any]) -> Any:
    """A JSON skeleton of ``value``; its tensors and Python values go into ``flat`` by key."""
    if isinstance(value, Mapping):
        items = []
        for k, v in value.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise ConfigError(f"checkpoint key {k!r} at {path or '/'} is not a str or int")
            items.append([k, _flatten(v, f"{path}.{k}" if path else str(k), flat)])
        return {"dict": items}
    if isinstance(value, (list, tuple)) and any(_has_tensor(v) for v in value):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_flatten(v, f"{path}.{i}", flat) for i, v in enumerate(value)]}
    key = path
    while key in flat:  # two paths that join alike ("a.b" under "a" and "a.b" at the top)
        key += "~"
    flat[key] = value
    if isinstance(value, torch.Tensor):
        return {"tensor": key, "shape": list(value.shape), "dtype": str(value.dtype)[6:]}
    return {"value": key}


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def _template(skeleton: Any, flat: dict[str, Any]) -> None:
    """Empty tensors and placeholders for every key of ``skeleton``, to restore into."""
    if "dict" in skeleton:
        for _, child in skeleton["dict"]:
            _template(child, flat)
    elif "list" in skeleton or "tuple" in skeleton:
        for child in skeleton.get("list", skeleton.get("tuple")):
            _template(child, flat)
    elif "tensor" in skeleton:
        flat[skeleton["tensor"]] = torch.empty(skeleton["shape"],
                                               dtype=getattr(torch, skeleton["dtype"]))
    else:
        flat[skeleton["value"]] = None


def _rebuild(skeleton: Any, flat: Mapping[str, Any]) -> Any:
    if "dict" in skeleton:
        return {k: _rebuild(child, flat) for k, child in skeleton["dict"]}
    if "list" in skeleton:
        return [_rebuild(child, flat) for child in skeleton["list"]]
    if "tuple" in skeleton:
        return tuple(_rebuild(child, flat) for child in skeleton["tuple"])
    return flat[skeleton.get("tensor", skeleton.get("value"))]


def _run_name() -> str:
    """A new run's root name: sortable by start time, unique by its random suffix."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)


def _fingerprint(flat: Mapping[str, Any]) -> tuple[Any, ...]:
    """Where each tensor lives and how often it was changed in place: equal for two saves only
    if no tensor was replaced or modified in between (Python values are not compared: they
    hold the callbacks' bookkeeping, which differs between ``last.ckpt`` and the top-k save of
    the same step). Only the model's and the optimizers' tensors count: callbacks keep tensors
    too (``best_model_score``, ``current_score``) that one callback changes between the saves
    of one step by several callbacks."""
    out: list[Any] = []
    for key, value in sorted(flat.items()):
        if isinstance(value, torch.Tensor) and key.startswith(("state_dict.",
                                                               "optimizer_states.")):
            try:
                where: Any = (value.data_ptr(), value.device)
            except (RuntimeError, NotImplementedError):  # tensors without storage
                where = id(value)
            out.append((key, where, value._version, tuple(value.shape), value.dtype))
    return tuple(out)


class _Run(CheckpointListener):
    """One run's root under ``DIR/.ckptmgr/`` and the pointer files this plugin wrote in ``DIR``.

    ``on_save_end`` runs on the writer thread for async saves; everything else on the caller's.
    """

    def __init__(self, dirpath: str, name: str, mgr: CheckpointManager, storage: Any,
                 runs_root: str | None) -> None:
        self.dirpath = dirpath
        self.name = name
        self.runs_root = runs_root  # the root= argument, or None: DIR/DATA_DIR
        self.mgr = mgr
        self.storage = storage  # DIR's, for the pointer files
        self.lock = threading.Lock()
        self.saved: dict[int, tuple[Any, ...]] = {}  # step -> fingerprint of the state saved
        self.committed: set[int] = set()
        self.names: dict[str, int] = {}  # pointer file -> the step it points to
        self.written: dict[str, bytes] = {}  # pointer file -> the bytes written into it

    def pointer(self, step: int) -> bytes:
        doc: dict[str, Any] = {POINTER_KEY: step, RUN_KEY: self.name}
        if self.runs_root is not None:
            doc[ROOT_KEY] = self.runs_root
        return json.dumps(doc).encode("utf-8")

    def point(self, step: int, name: str) -> None:
        """Write the pointer ``name`` -> ``step`` now (the step may still be in flight). What
        the file named before goes into it too: if this step never commits (the process is
        killed mid-save), loading the pointer falls back to that (``last.ckpt`` keeps
        resolving)."""
        data = self.pointer(step)
        prev = _previous_target(self.storage, name)
        if prev is not None and prev != json.loads(data):
            data = json.dumps({**json.loads(data), PREV_KEY: prev}).encode("utf-8")
        self.storage.write_bytes(name, data)
        self.names[name] = step
        self.written[name] = data

    def on_save_end(self, stats: SaveStats) -> None:
        with self.lock:
            self.committed.add(stats.step)

    def drop_deleted(self) -> None:
        """Remove the pointers to steps that committed and are gone since (retention)."""
        with self.lock:
            gone = self.committed - set(self.mgr.all_steps())
            self.committed -= gone
        if not gone:
            return
        for step in gone:
            self.saved.pop(step, None)
        for name, step in list(self.names.items()):
            if step not in gone:
                continue
            del self.names[name]
            try:  # only if it still points here: Lightning may have written another since
                want = self.written.pop(name, self.pointer(step))
                if self.storage.exists(name) and self.storage.size(name) == len(want) and \
                        self.storage.read_bytes(name, 0, len(want)) == want:
                    self.storage.remove(name)
                    log.info("lightning: removed %s/%s: step %d of run %s was deleted by "
                             "retention", self.dirpath, name, step, self.name)
            except OSError as e:  # a pointer left behind must not fail the training step
                log.warning("lightning: could not remove %s/%s (step %d deleted by retention): "
                            "%s", self.dirpath, name, step, e)


def _target(doc: Any, dirpath: str) -> tuple[str, int]:
    """The (root, step) a pointer document names.

    Raises:
        ValueError, KeyError, TypeError: not a pointer document.
    """
    step = int(doc[POINTER_KEY])
    run_name = doc.get(RUN_KEY)
    if run_name is not None and (not isinstance(run_name, str)
                                 or _RUN_NAME.fullmatch(run_name) is None):
        raise ValueError(f"run name {run_name!r}")
    runs_root = doc.get(ROOT_KEY)
    if runs_root is not None and (run_name is None or not isinstance(runs_root, str)
                                  or not runs_root.strip("/")):
        raise ValueError(f"root {runs_root!r}")
    if run_name is None:  # a root of the plugin before runs: DIR itself
        return dirpath, step
    return f"{runs_root or dirpath.rstrip('/') + '/' + DATA_DIR}/{run_name}", step


def _previous_target(storage: Any, name: str) -> dict[str, Any] | None:
    """The target (step, run, root) of the pointer file ``name`` as it is now, without its own
    fallback; None when there is none or it does not parse."""
    try:
        if not storage.exists(name) or storage.size(name) > _MAX_POINTER:
            return None
        doc = json.loads(storage.read_bytes(name))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get(POINTER_KEY), int):
        return None
    return {k: doc[k] for k in (POINTER_KEY, RUN_KEY, ROOT_KEY) if k in doc}


class CkptmgrCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through :class:`~ckptmgr.CheckpointManager`.

    Steps go into ``DIR/.ckptmgr/RUN/`` (or ``root/RUN/``; a new root per run and directory; see
    the module docstring), pointer files at Lightning's paths.

    Args:
        async_save: save in the background (the state is captured, and the pointer file written,
            before the call returns).
        max_to_keep: retention of each run's root, as the manager's (None keeps every step).
        verify: check sizes and checksums when loading.
        storage_options: fsspec options of the root (endpoint, credentials, ...).
        trusted: allow checkpoint values that need pickle (e.g. custom hyper-parameter objects);
            leave False unless you trust whoever writes the root.
        root: where the runs' roots go (``root/RUN``, any URL; the pointers name it), for a
            checkpoint directory that holds nothing but Lightning's ``.ckpt`` files. None (the
            default): ``DIR/.ckptmgr/RUN``, so the directory moves and syncs as one.
        **manager_kwargs: any other :class:`~ckptmgr.CheckpointManager` keyword (``keep_period``,
            ...). ``chkpt_on_preemption`` and ``save_on_close`` default to False: Lightning
            decides when to save, and handles preemption itself.
    """

    def __init__(self, *, async_save: bool = True, max_to_keep: int | None = None,
                 verify: bool = True, storage_options: Mapping[str, Any] | None = None,
                 trusted: bool = False, root: str | None = None,
                 **manager_kwargs: Any) -> None:
        super().__init__()
        if root is not None and (not isinstance(root, str) or not root.strip("/")):
            raise ConfigError(f"root must be a directory path or URL (a str), got {root!r}")
        if root is not None and "://" not in root:  # pointers must not depend on the cwd
            root = os.path.abspath(root)
        self.root = None if root is None else root.rstrip("/")
        self.async_save = async_save
        self.trusted = trusted
        self.storage_options = dict(storage_options or {})
        self._kwargs: dict[str, Any] = {"max_to_keep": max_to_keep, "verify": verify,
                                        "chkpt_on_preemption": False, "save_on_close": False,
                                        **manager_kwargs}
        self._runs: dict[str, _Run] = {}  # DIR -> this run's root there
        self._readers: dict[str, CheckpointManager] = {}  # other roots, read-only

    def manager(self, dirpath: str) -> CheckpointManager:
        """The manager of this run's root for Lightning's directory ``dirpath`` (created at
        first use, under ``dirpath/.ckptmgr/``; closed by ``teardown``)."""
        return self._run(str(dirpath).rstrip("/") or "/").mgr

    def _run(self, dirpath: str) -> _Run:
        run = self._runs.get(dirpath)
        if run is None:
            name = _run_name()
            runs = self.root if self.root is not None else f"{dirpath.rstrip('/')}/{DATA_DIR}"
            root = f"{runs}/{name}"
            mgr = CheckpointManager(root, 1, storage_options=self.storage_options or None,
                                    **self._kwargs)
            storage = open_storage(dirpath, self.storage_options or None)
            storage.makedirs("")  # with root= elsewhere, nothing else creates DIR
            run = _Run(dirpath, name, mgr, storage, self.root)
            mgr.add_listener(run)
            self._runs[dirpath] = run
            log.info("lightning: this run saves the steps of %s under %s", dirpath, root)
        return run

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as step ``checkpoint["global_step"]`` of this run's root for the
        path's directory; the pointer file at ``path`` exists when this returns."""
        if storage_options is not None:
            raise TypeError("CkptmgrCheckpointIO takes storage_options in its constructor")
        dirpath, name = _split(path)
        step = checkpoint.get("global_step") if isinstance(checkpoint, Mapping) else None
        if isinstance(step, bool) or not isinstance(step, (int, torch.Tensor)):
            # e.g. the bare state_dict that ddp_spawn's launcher passes between processes
            raise ConfigError(f"cannot save {path}: CkptmgrCheckpointIO saves a Lightning "
                              f"trainer checkpoint, whose 'global_step' (an int) is its step; "
                              f"this one has {type(step).__name__ if step is not None else 'none'}"
                              " (strategies that spawn processes, such as ddp_spawn, are not "
                              "supported)")
        step = int(step)
        run = self._run(dirpath)
        flat: dict[str, Any] = {}
        skeleton = _flatten(checkpoint, "", flat)
        fingerprint = _fingerprint(flat)
        # e.g. last.ckpt after epoch=..-step=N.ckpt: the same tensors at the same step, saved
        # once. Only this run's steps count: another run's step N is never reused.
        if step in run.saved and run.saved[step] != fingerprint:
            # Step N of this run holds other tensors (weights changed since, or a weights-only
            # save): the pointers to it must keep reading what they pointed to, so this save
            # starts a new run root instead of overwriting the step.
            log.info("lightning: step %d of run %s was saved with other tensors; %s starts a "
                     "new run root", step, run.name, name)
            del self._runs[dirpath]
            run.mgr.close()
            run.drop_deleted()
            run = self._run(dirpath)
        if step not in run.saved:
            save = run.mgr.save_async if self.async_save else run.mgr.save
            save(step, flat, force=True, metadata={"lightning": skeleton}, trusted=self.trusted)
            run.saved[step] = fingerprint
        run.point(step, name)
        run.drop_deleted()

    def _reader(self, root: str) -> CheckpointManager:
        """The manager to read ``root`` with: this run's (after its save in flight), or a
        read-only one (another run's root; no lease taken)."""
        for run in self._runs.values():
            runs = run.runs_root or f"{run.dirpath.rstrip('/')}/{DATA_DIR}"
            if run.mgr.path.rstrip("/") == root.rstrip("/") or f"{runs}/{run.name}" == root:
                run.mgr.join()
                return run.mgr
        if root not in self._readers:
            self._readers[root] = CheckpointManager(
                root, 1, read_only=True, storage_options=self.storage_options or None,
                verify=self._kwargs["verify"], chkpt_on_preemption=False, save_on_close=False)
        return self._readers[root]

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint the path points to (CPU tensors; Lightning moves them).

        Raises:
            CheckpointNotFoundError: no file at ``path``, or its step is not there (deleted by
                retention, or its save never committed).
            ConfigError: ``path`` is not a pointer file of this plugin.
        """
        dirpath, name = _split(path)
        step = parse_step_name(name)
        root = dirpath  # a step directory DIR/.ckptmgr/RUN/500: its root is DIR/.ckptmgr/RUN
        if step is None:
            storage = open_storage(dirpath, self.storage_options or None, writable=False)
            if not storage.exists(name):
                raise CheckpointNotFoundError(f"{path} does not exist")
            try:
                size = storage.size(name)
                if size > _MAX_POINTER:
                    raise ValueError(f"{size} bytes")
                doc = json.loads(storage.read_bytes(name, 0, size))
                root, step = _target(doc, dirpath)
                prev = doc.get(PREV_KEY) if isinstance(doc, dict) else None
                fallback = _target(prev, dirpath) if isinstance(prev, dict) else None
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"{path} is not a ckptmgr pointer file (a checkpoint saved "
                                  "without CkptmgrCheckpointIO?)") from e
            if step not in self._reader(root).all_steps() and fallback is not None and (
                    fallback[1] in self._reader(fallback[0]).all_steps()):
                log.warning("lightning: %s points to step %d under %s, whose save never "
                            "committed (the process stopped mid-save?); loading what it "
                            "pointed to before: step %d under %s", path, step, root,
                            fallback[1], fallback[0])
                root, step = fallback
        mgr = self._reader(root)
        if step not in mgr.all_steps():
            raise CheckpointNotFoundError(
                f"{path} points to step {step} under {root}, which is not there: deleted by "
                f"ckptmgr's retention (max_to_keep), or its save never committed; steps "
                f"there: {mgr.all_steps()[-5:]}")
        skeleton = mgr.step_info(step).metadata.get("lightning")
        if skeleton is None:
            raise ConfigError(f"step {step} of {mgr.path} was not saved by CkptmgrCheckpointIO")
        flat: dict[str, Any] = {}
        _template(skeleton, flat)
        mgr.restore(step, flat, trusted=self.trusted)
        return dict(_rebuild(skeleton, flat))

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path``; the step stays until ckptmgr's retention drops it."""
        dirpath, name = _split(path)
        storage = open_storage(dirpath, self.storage_options or None)
        if storage.exists(name):
            storage.remove(name)
        run = self._runs.get(dirpath)
        if run is not None:
            run.names.pop(name, None)

    def teardown(self) -> None:
        """Wait for the save in flight, remove pointers to steps retention deleted, then close
        the managers. The next save starts a new run (a new root)."""
        runs, self._runs = self._runs, {}
        readers, self._readers = self._readers, {}
        try:
            for run in runs.values():
                run.mgr.close()
                run.drop_deleted()
        finally:
            for mgr in readers.values():
                mgr.close()
