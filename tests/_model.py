"""Helpers of the stateful model test (tests/adversary/test_model_lifecycle.py): simulated
processes over real storage, the saved states, snapshots of a root, and the reference retention
rule.

A *process* here is a :class:`Process`: every storage a manager opens while the process is the
tap's current one is wrapped (tests/_faulty.py :func:`wrap`) and routed through it, so the test
can kill the process at a chosen storage operation (from then on everything it does fails, as if
it had been SIGKILLed there: nothing after the crash point reaches storage) or hold its threads at
a point of the commit protocol (gates, so interleavings are arranged, not timed).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import fsspec
import pytest
import torch
from _faulty import FaultyStorage, Gate, wrap

import ckptmgr.storage
from ckptmgr.codec.layout import MANIFEST_NAME, parse_staging_name
from ckptmgr.errors import StorageError
from ckptmgr.lease import LEASE_NAME

# Storage operations that change something; a crash point counts these (not the lease's own).
MUTATING = frozenset({"write_bytes", "open_writer", "write", "writev", "commit", "makedirs",
                      "rename", "fsync_dir", "remove"})


class Process:
    """One simulated process: faults and gates shared by every storage its managers opened.

    ``crash_at``: the process dies right before its ``crash_at``-th mutating storage operation
    (lease renewals aside). ``hold_after_commit``/``hold_before_commit``: ``(step, gate)``; the
    durable root's commit of ``step`` holds its thread at the gate: after the commit (at the
    next storage operation of that thread) or right before it.
    """

    def __init__(self, durable_url: str) -> None:
        self.durable_url = durable_url
        self.dead = False
        self.crash_at: int | None = None
        self.ops = 0
        self.hold_after_commit: tuple[int, Gate] | None = None
        self.hold_before_commit: tuple[int, Gate] | None = None
        # (path part, callback): called once, right before this process first reads a path
        # holding that part (in the reading thread), e.g. to run retention in the middle.
        self.on_read: tuple[str, Callable[[], None]] | None = None
        self._after: tuple[int, Gate] | None = None  # (thread id, gate) armed by a commit
        self._lock = threading.Lock()

    def kill(self) -> None:
        """From now on every storage operation of this process fails."""
        self.dead = True

    def before(self, storage: FaultyStorage, op: str, path: str) -> None:
        """Called before each storage operation of this process (in the calling thread)."""
        if self.dead:
            raise _dead(storage, op, path)
        me = threading.get_ident()
        with self._lock:
            if self.crash_at is not None and op in MUTATING and not path.endswith(LEASE_NAME):
                self.ops += 1
                if self.ops >= self.crash_at:
                    self.dead = True
                    raise _dead(storage, op, path)
            after, durable = self._after, storage.url == self.durable_url
        if after is not None and after[0] == me:
            self._after = None
            after[1].pass_()
        hook = self.on_read
        if hook is not None and op not in MUTATING and hook[0] in path:
            self.on_read = None
            hook[1]()
        step = _commit_of(op, path) if durable else None
        if step is None:
            return
        if self.hold_before_commit is not None and self.hold_before_commit[0] == step:
            gate = self.hold_before_commit[1]
            self.hold_before_commit = None
            gate.pass_()
        if self.hold_after_commit is not None and self.hold_after_commit[0] == step:
            self._after = (me, self.hold_after_commit[1])
            self.hold_after_commit = None


def _dead(storage: FaultyStorage, op: str, path: str) -> StorageError:
    # Caused by EIO, not ENOENT: nothing may read a dead process's failure as "not found".
    err = StorageError(f"{op} failed for {storage.url}/{path} (the process crashed here)")
    err.__cause__ = OSError(errno.EIO, "the process crashed here (injected)", path)
    return err


def _commit_of(op: str, path: str) -> int | None:
    """The step a durable commit operation makes visible: the manifest written straight into
    the step directory (object stores, overwrites) or the staging directory renamed into place."""
    if op == "write_bytes" and path.endswith(f"/{MANIFEST_NAME}"):
        head = path[:-len(MANIFEST_NAME) - 1]
        return int(head) if head.isdigit() else None
    if op == "rename":
        staged = parse_staging_name(path)
        return staged[0] if staged is not None else None
    return None


class Tap:
    """Routes every storage ckptmgr opens through the current :class:`Process`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.current: Process | None = None
        real = ckptmgr.storage.open_storage

        def opener(*args: Any, **kwargs: Any) -> Any:
            st = wrap(real(*args, **kwargs))
            proc = self.current
            if proc is not None:
                st._check = lambda op, path: proc.before(st, op, path)  # type: ignore[method-assign]
            return st

        monkeypatch.setattr(ckptmgr.storage, "open_storage", opener)
        for name, mod in list(sys.modules.items()):
            if name.startswith("ckptmgr") and getattr(mod, "open_storage", None) is real:
                monkeypatch.setattr(mod, "open_storage", opener)

    @contextmanager
    def process(self, proc: Process | None) -> Iterator[Process | None]:
        """Storages opened inside the block belong to ``proc`` (None: plain, never faulty)."""
        before, self.current = self.current, proc
        try:
            yield proc
        finally:
            self.current = before


class Clock:
    """The commit time written into manifests, chosen by the model per saved version.

    A save passes ``metadata={"model_seed": seed}``; the manifest of that save gets the time
    registered for the seed in :attr:`times` (a wall clock would race with the model: an async
    save commits after the model has moved on to the next one).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.times: dict[int, int] = {}
        import ckptmgr.dcp.writer
        from ckptmgr.codec.manifest import Manifest as real

        def manifest(**kwargs: Any) -> Any:
            seed = (kwargs.get("metadata") or {}).get("model_seed")
            if seed in self.times:
                kwargs["time"] = datetime.fromtimestamp(self.times[seed], timezone.utc).strftime(
                    "%Y-%m-%dT%H:%M:%S.%fZ")
            return real(**kwargs)

        monkeypatch.setattr(ckptmgr.dcp.writer, "Manifest", manifest)


# ------------------------------------------------------------------------------ saved states


def make_state(seed: int) -> dict[str, Any]:
    """The training state saved as version ``seed``: tensors of three dtypes and Python values,
    and two tensors large enough to be shared chunks with ``reuse_unchanged=True`` (16 KiB): a
    frozen one, the same in every version, and a trained one of this version."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 5, generator=g),
        "b": torch.randint(-2**40, 2**40, (6,), generator=g),
        "h": torch.randn(3, generator=g).to(torch.bfloat16),
        "frozen": torch.randn(64, 64, generator=torch.Generator().manual_seed(0)),
        "trained": torch.randn(64, 64, generator=g),
        "extra": {"seed": seed, "tags": [seed % 7, f"s{seed}", None, seed / 3]},
    }


def blank_state() -> dict[str, Any]:
    """A restore target holding values no saved version has."""
    return {"w": torch.full((4, 5), -9.0), "b": torch.full((6,), -9, dtype=torch.int64),
            "h": torch.full((3,), -9.0, dtype=torch.bfloat16),
            "frozen": torch.full((64, 64), -9.0), "trained": torch.full((64, 64), -9.0),
            "extra": {"seed": -1, "tags": []}}


def _bits(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())


def same_state(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Bit-exact equality of two states (tensors byte for byte, values by ==)."""
    if set(a) != set(b):
        return False
    for k in a:
        if isinstance(a[k], torch.Tensor):
            if not isinstance(b[k], torch.Tensor) or _bits(a[k]) != _bits(b[k]):
                return False
        elif a[k] != b[k]:
            return False
    return True


def tensors_from(target: Mapping[str, Any], *allowed: Mapping[str, Any]) -> list[str]:
    """The tensors of ``target`` equal to none of ``allowed``'s (e.g. holding damaged bytes)."""
    return [k for k, v in target.items() if isinstance(v, torch.Tensor)
            and all(_bits(v) != _bits(s[k]) for s in allowed)]


# ---------------------------------------------------------------------------------- storage


def url_fs(url: str) -> tuple[Any, str]:
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/")


def put(url: str, rel: str, data: bytes) -> None:
    """Write ``data`` at ``url/rel`` behind ckptmgr's back."""
    fs, path = url_fs(url)
    full = f"{path}/{rel}"
    fs.makedirs(full.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(full, data)


def snapshot(url: str) -> dict[str, bytes]:
    """Every file under ``url`` (relative name -> bytes). A lease file is reduced to its
    holder's id: renewals rewrite its expiry, not who holds it."""
    fs, path = url_fs(url)
    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache()
    if not fs.exists(path):
        return {}
    out: dict[str, bytes] = {}
    for p in fs.find(path):
        rel = p[len(path) + 1:]
        data = fs.cat_file(p)
        if rel.endswith(LEASE_NAME):
            with suppress(ValueError):
                data = str(json.loads(data).get("id")).encode()
        out[rel] = data
    return out


def remove_tree(url: str) -> None:
    fs, path = url_fs(url)
    if hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache()
    if fs.exists(path):
        fs.rm(path, recursive=True)


def damage(path: str, how: str) -> None:
    """Damage the local file ``path``: flip one byte in the middle, or drop its last 8 bytes."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if how == "flip":
        data[len(data) // 2] ^= 0x5A
    else:
        del data[-8:]
    with open(path, "wb") as f:
        f.write(bytes(data))


def data_files(step_dir: str) -> list[str]:
    return sorted(os.path.join(step_dir, n) for n in os.listdir(step_dir)
                  if n.startswith("data-"))


# ------------------------------------------------------------------------------- retention


@dataclass(frozen=True)
class Version:
    """One saved version of a step: which state (``seed``), its commit time and metric."""

    seed: int
    time: int
    loss: float


@dataclass(frozen=True)
class Policy:
    """The retention options of a model run (the constructor's keywords)."""

    max_to_keep: int | None = None
    keep_period: int | None = None
    keep_time_interval: float | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    keep_best: int | None = None

    def kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def keeps(self, steps: Mapping[int, Version]) -> set[int]:
        """What retention keeps of the committed ``steps``, written from docs/retention.md: the
        union of the newest ``max_to_keep``, every ``keep_period``-th, one per
        ``keep_time_interval`` seconds (walking steps upwards from the first) and the
        ``keep_best`` best by the metric (ties: the newer step); always the newest step.
        ``max_to_keep`` None or 0 keeps everything."""
        order = sorted(steps)
        if not order:
            return set()
        if not self.max_to_keep:
            return set(order)
        keep = set(order[-self.max_to_keep:]) | {order[-1]}
        if self.keep_period:
            keep |= {s for s in order if s % self.keep_period == 0}
        if self.keep_time_interval:
            last: int | None = None
            for s in order:
                if last is None or steps[s].time >= last + self.keep_time_interval:
                    keep.add(s)
                    last = steps[s].time
        if self.best_metric:
            sign = 1 if self.best_mode == "min" else -1
            ranked = sorted(order, key=lambda s: (sign * steps[s].loss, -s))
            keep |= set(ranked[:self.keep_best or 1])
        return keep


def newest(steps: Mapping[int, Any] | set[int], k: int) -> set[int]:
    """The ``k`` largest step numbers."""
    return set(sorted(steps)[-k:])
