"""``CkptmgrCheckpointIO``: Lightning's checkpoint I/O through ckptmgr (``pip install
"ckptmgr[lightning]"``)::

    trainer = lightning.Trainer(
        plugins=[CkptmgrCheckpointIO(max_to_keep=3)],
        callbacks=[ModelCheckpoint(dirpath="s3://bucket/run-7", every_n_train_steps=500,
                                   save_last=True)])
    trainer.fit(model, ckpt_path="last")

How Lightning's file paths map onto steps (docs/integrations.md):
- a path's directory is the root; the checkpoint's ``global_step`` is the step. Saving
  ``ROOT/epoch=0-step=500.ckpt`` saves step 500 under ``ROOT`` (``ROOT/500/``) with ckptmgr's
  async queue, retention and checksums;
- once the step has committed, a small JSON pointer file is written at the path itself
  (``{"ckptmgr_step": 500}``), so Lightning's own file checks, ``save_last`` and
  ``fit(ckpt_path="last")`` find it. ``last.ckpt`` saved at the same step points to the same step:
  nothing is written twice;
- loading a path reads its pointer (or, for a step directory ``ROOT/500``, that step);
- removing a path (``save_top_k``) removes the pointer only: steps are deleted by ckptmgr's
  retention (``max_to_keep`` and the other retention arguments), never by Lightning.

Single-process strategies (CPU, one GPU) only: Lightning calls the plugin's save on global rank
zero alone, while a ckptmgr save is collective over every rank.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.plugins.io import CheckpointIO

from ckptmgr.errors import CheckpointNotFoundError, ConfigError
from ckptmgr.events import CheckpointListener
from ckptmgr.info import SaveStats
from ckptmgr.layout import parse_step_name
from ckptmgr.manager import CheckpointManager
from ckptmgr.storage import open_storage

__all__ = ["POINTER_KEY", "CkptmgrCheckpointIO"]

log = logging.getLogger("ckptmgr")

POINTER_KEY = "ckptmgr_step"
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


class _Pointers(CheckpointListener):
    """Writes each path's pointer file once its step has committed (on the writer thread for
    async saves)."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.pending: dict[int, list[str]] = {}
        self.queued: set[int] = set()  # steps saved (or queued) through this plugin
        self.committed: set[int] = set()
        self.lock = threading.Lock()

    def add(self, step: int, name: str) -> None:
        """Point ``name`` at ``step`` now if it has committed, else when it does."""
        with self.lock:
            if step not in self.committed:
                self.pending.setdefault(step, []).append(name)
                return
        self.write(step, name)

    def write(self, step: int, name: str) -> None:
        self.storage.write_bytes(name, json.dumps({POINTER_KEY: step}).encode("utf-8"))

    def on_save_end(self, stats: SaveStats) -> None:
        with self.lock:
            self.committed.add(stats.step)
            names = self.pending.pop(stats.step, [])
        for name in names:
            self.write(stats.step, name)


class CkptmgrCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through :class:`~ckptmgr.CheckpointManager`.

    Args:
        async_save: save in the background (the state is captured before the call returns).
        max_to_keep: retention, as the manager's (None keeps every step).
        verify: check sizes and checksums when loading.
        storage_options: fsspec options of the root (endpoint, credentials, ...).
        trusted: allow checkpoint values that need pickle (e.g. custom hyper-parameter objects);
            leave False unless you trust whoever writes the root.
        **manager_kwargs: any other :class:`~ckptmgr.CheckpointManager` keyword (``keep_period``,
            ``overwrite``, ...). ``chkpt_on_preemption`` defaults to False: Lightning calls save
            only when its callbacks decide, so it handles preemption itself.
    """

    def __init__(self, *, async_save: bool = True, max_to_keep: int | None = None,
                 verify: bool = True, storage_options: Mapping[str, Any] | None = None,
                 trusted: bool = False, **manager_kwargs: Any) -> None:
        super().__init__()
        self.async_save = async_save
        self.trusted = trusted
        self.storage_options = dict(storage_options or {})
        self._kwargs: dict[str, Any] = {"max_to_keep": max_to_keep, "verify": verify,
                                        "chkpt_on_preemption": False, **manager_kwargs}
        self._managers: dict[str, tuple[CheckpointManager, _Pointers]] = {}

    def manager(self, root: str) -> CheckpointManager:
        """The manager of ``root`` (created at first use; closed by ``teardown``)."""
        return self._open(root)[0]

    def _open(self, root: str) -> tuple[CheckpointManager, _Pointers]:
        if root not in self._managers:
            mgr = CheckpointManager(root, 1, storage_options=self.storage_options or None,
                                    **self._kwargs)
            pointers = _Pointers(open_storage(root, self.storage_options or None))
            mgr.add_listener(pointers)
            self._managers[root] = (mgr, pointers)
        return self._managers[root]

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as step ``checkpoint["global_step"]`` under the path's directory;
        the pointer at ``path`` appears when the step has committed."""
        if storage_options is not None:
            raise TypeError("CkptmgrCheckpointIO takes storage_options in its constructor")
        root, name = _split(path)
        step = int(checkpoint["global_step"])
        mgr, pointers = self._open(root)
        if step in pointers.queued or step in mgr.all_steps():
            # e.g. last.ckpt after epoch=..-step=N.ckpt: the same step, saved once
            if step not in pointers.queued:
                pointers.committed.add(step)
            pointers.add(step, name)
            return
        flat: dict[str, Any] = {}
        skeleton = _flatten(checkpoint, "", flat)
        pointers.queued.add(step)
        pointers.add(step, name)
        save = mgr.save_async if self.async_save else mgr.save
        save(step, flat, force=True, metadata={"lightning": skeleton}, trusted=self.trusted)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint the path points to (CPU tensors; Lightning moves them)."""
        root, name = _split(path)
        mgr = self.manager(root)
        mgr.join()
        step = parse_step_name(name)
        if step is None:
            storage = open_storage(root, self.storage_options or None, writable=False)
            if not storage.exists(name):
                raise CheckpointNotFoundError(
                    f"{path} does not exist (steps under {mgr.path}: {mgr.all_steps()[-5:]})")
            try:
                size = storage.size(name)
                if size > _MAX_POINTER:
                    raise ValueError(f"{size} bytes")
                step = int(json.loads(storage.read_bytes(name, 0, size))[POINTER_KEY])
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{path} is not a ckptmgr pointer file (a checkpoint saved "
                                  "without CkptmgrCheckpointIO?)") from e
        skeleton = mgr.step_info(step).metadata.get("lightning")
        if skeleton is None:
            raise ConfigError(f"step {step} of {mgr.path} was not saved by CkptmgrCheckpointIO")
        flat: dict[str, Any] = {}
        _template(skeleton, flat)
        mgr.restore(step, flat, trusted=self.trusted)
        return dict(_rebuild(skeleton, flat))

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path``; the step stays until ckptmgr's retention drops it."""
        root, name = _split(path)
        storage = open_storage(root, self.storage_options or None)
        if storage.exists(name):
            storage.remove(name)

    def teardown(self) -> None:
        """Wait for the save in flight (and write its pointers), then close the managers."""
        managers, self._managers = self._managers, {}
        for mgr, _ in managers.values():
            mgr.close()
