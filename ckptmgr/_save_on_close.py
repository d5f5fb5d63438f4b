"""``save_on_close``: the newest step given to save/save_async and not saved, and whether a normal
``close()`` saves it.

A step given but not due is remembered with the tensors' versions at that call (local: no
collective per training step). At ``close()`` it is saved when it is newer than the newest
committed step and the state did not change since the call; otherwise one warning says why not.
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptmgr._dist import Comm
from ckptmgr.dcp.state import flatten_state
from ckptmgr.errors import CkptmgrError, ConfigError

__all__ = ["Given", "LastGiven", "state_versions"]

log = logging.getLogger("ckptmgr")


@dataclass(frozen=True)
class Given:
    """The newest step given to save/save_async and not saved: the call (``request``, the
    manager's checked arguments), and the tensors' versions then, to tell whether the state
    changed since."""

    step: int
    first: int  # the oldest step given since the last one saved
    state_dict: Mapping[str, Any]
    request: Any
    versions: tuple[Any, ...] | None  # None: the state could not be read at the call


def state_versions(state_dict: Mapping[str, Any]) -> tuple[Any, ...]:
    """Where each tensor of the state lives and how often it was modified in place, and a digest
    of every other value (a data loader's position, random generator states, counters): equal
    before and after only if nothing was replaced or changed in between. Writes through
    ``tensor.data`` bypass the version counter and are not seen (docs/quickstart.md).

    Raises:
        ConfigError: flattening the state failed (a ``state_dict()`` of the user's raised).
    """
    from torch.distributed.tensor import DTensor

    try:
        flat = flatten_state(state_dict).flat
    except CkptmgrError:
        raise
    except Exception as e:
        raise ConfigError(f"reading the state (its state_dict() methods) failed: "
                          f"{type(e).__name__}: {e}") from e
    out: list[Any] = []
    for key, value in sorted(flat.items()):
        if isinstance(value, torch.Tensor):
            t = value.to_local() if isinstance(value, DTensor) else value
            try:
                where: Any = (t.data_ptr(), t.device)
            except (RuntimeError, NotImplementedError):
                # No storage (XLA): a module's state_dict() hands out new tensor objects at each
                # call, so only the version counter (shared with them) tells a change.
                where = str(t.device)
            out.append((key, where, t._version, tuple(t.shape), t.dtype))
        else:
            out.append((key, hashlib.blake2b(repr(value).encode(), digest_size=16).digest()))
    return tuple(out)


class LastGiven:
    """The newest step given and not saved, on this rank (every rank alike: saves are
    collective).

    Args:
        enabled: ``save_on_close``; when False, close() only warns about a step not saved.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.given: Given | None = None

    def remember(self, step: int, state_dict: Mapping[str, Any], request: Any) -> None:
        """(caller thread, local) Note ``step``, given but not saved."""
        if self.given is not None and step < self.given.step:
            return
        first = self.given.first if self.given is not None else step
        versions: tuple[Any, ...] | None = ()
        if self.enabled:
            # Local, no collective (a step that is not due meets no other rank): a state that
            # cannot be read now is "changed" at close(), where the ranks agree on it.
            try:
                versions = state_versions(state_dict)
            except CkptmgrError as e:
                log.debug("step %d: the state could not be read for save_on_close: %s", step, e)
                versions = None
        self.given = Given(step, first, state_dict, request, versions)

    def saved(self, step: int) -> None:
        """A save of ``step`` covers every step given up to it."""
        if self.given is not None and self.given.step <= step:
            self.given = None

    def to_save(self, comm: Comm, newest: int | None) -> Given | None:
        """(collective over ``comm`` when a step is pending) The step a normal close() saves:
        the newest given, if newer than ``newest`` (the newest committed) and unchanged since;
        else None, with one warning when a step is left unsaved."""
        given = self.given
        if given is None or (newest is not None and given.step <= newest):
            return None
        steps = (f"step {given.step}" if given.first == given.step
                 else f"steps {given.first}-{given.step}")
        after = f"the newest committed step {newest}" if newest is not None else "no step"
        if not self.enabled:
            warnings.warn(
                f"close(): {steps} were given to save/save_async but not saved ({after} is "
                "committed) and save_on_close=False; pass force=True on the last step to save "
                "it", RuntimeWarning, stacklevel=4)
            return None
        changed = comm.agree(  # on every rank alike: a collective either way
            lambda: given.versions is None or state_versions(given.state_dict) != given.versions)
        if comm.any(changed):
            warnings.warn(
                f"close(): {steps} not saved: the state changed after save/save_async was "
                f"called with step {given.step} ({after} is committed), so it no longer is "
                "that step's state; pass force=True on the last step to save it",
                RuntimeWarning, stacklevel=4)
            return None
        log.info("close(): saving step %d, newer than %s (save_on_close=True)", given.step,
                 after)
        return given
