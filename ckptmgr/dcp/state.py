"""Flattening user state dicts for DCP, and putting loaded Python values back in place.

Rules (close to DCP's own ``flatten_state_dict``, with two differences: the original keys are kept
so int-keyed dicts are restored in place, and ``Stateful`` objects are resolved at any depth):
- a ``Stateful`` (``state_dict()`` + ``load_state_dict()``) is replaced by its state dict; on
  restore (``saved`` given), a Stateful that defines ``state_dict_for_restore(saved_keys)`` is
  replaced by what that returns instead: ``saved_keys`` are the flat keys the step holds under the
  Stateful's own path, with that path and its '.' removed, so the Stateful can ask for what exists
  (:class:`ckptmgr.rng.RNGState`: a rank that did not exist at save time asks for rank 0's state);
- a mapping is always traversed; its keys must be ``str`` or ``int``;
- a list or tuple is traversed when it holds (at any depth) a tensor or a Stateful, else it is a
  single Python value;
- everything else is a leaf: a tensor (or a :class:`~ckptmgr.dcp.shards.ShardedTensor`), or a
  Python value stored as tagged JSON.
The flat key of a leaf is its path joined with '.'. Two paths joining to one key are an error.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

from ckptmgr.dcp.shards import ShardedTensor
from ckptmgr.errors import ConfigError

__all__ = ["FlatState", "check_state_dict", "flatten_state", "set_at_path"]

PathKey = str | int
_TENSORS = (torch.Tensor, ShardedTensor)
_MAX_DEPTH = 200


@dataclass
class _Root:
    container: Any
    owner: Stateful | None = None


@dataclass
class FlatState:
    """A state dict flattened for DCP.

    Attributes:
        flat: flat key -> tensor or Python value.
        where: flat key -> (root index, path inside that root) to set a loaded value.
        roots: the user's dict (index 0) and the state dict of each Stateful found.
    """

    flat: dict[str, Any] = field(default_factory=dict)
    where: dict[str, tuple[int, tuple[PathKey, ...]]] = field(default_factory=dict)
    roots: list[_Root] = field(default_factory=list)

    def tensor_keys(self) -> list[str]:
        """Flat keys whose leaf is a tensor."""
        return [k for k, v in self.flat.items() if isinstance(v, _TENSORS)]

    def value_keys(self) -> list[str]:
        """Flat keys whose leaf is a Python value."""
        return [k for k, v in self.flat.items() if not isinstance(v, _TENSORS)]

    def apply_values(self, values: Mapping[str, Any]) -> None:
        """Set loaded Python values in place, then ``load_state_dict`` every Stateful (deepest
        first) with its updated state dict."""
        for key, value in values.items():
            root_index, path = self.where[key]
            root = self.roots[root_index]
            root.container = set_at_path(root.container, path, value)
        for root in reversed(self.roots[1:]):
            assert root.owner is not None
            root.owner.load_state_dict(root.container)


def _holds_tensor(value: Any, depth: int = 0) -> bool:
    if depth > _MAX_DEPTH:
        return False
    if isinstance(value, (torch.Tensor, ShardedTensor, Stateful)):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v, depth + 1) for v in value)
    return False


def check_state_dict(state_dict: Any, *, what: str = "state_dict") -> Mapping[str, Any]:
    """``state_dict`` when it is a mapping (the argument of save, save_async and restore), checked
    before any I/O.

    Raises:
        ConfigError: anything else (a list, None, a tensor, a module), naming its type and what is
            expected.
    """
    if isinstance(state_dict, Mapping):
        return state_dict
    hint = ""
    if isinstance(state_dict, Stateful):
        hint = " (wrap the object in a dict: {'model': model})"
    elif isinstance(state_dict, (torch.Tensor, ShardedTensor)):
        hint = " (give the tensor a name: {'weights': tensor})"
    raise ConfigError(
        f"{what} must be a dict of the state to save or restore, e.g. "
        f"{{'model': model, 'optim': optimizer}}, got {type(state_dict).__name__}{hint}")


def _saved_under(saved: Collection[str], key: str) -> frozenset[str]:
    prefix = f"{key}."
    return frozenset(k[len(prefix):] for k in saved if k.startswith(prefix))


def flatten_state(state_dict: Mapping[str, Any], *,
                  saved: Collection[str] | None = None) -> FlatState:
    """Flatten ``state_dict``; calls ``state_dict()`` on every Stateful found.

    Args:
        state_dict: the user's state.
        saved: on restore, the flat keys the step holds: a Stateful with a
            ``state_dict_for_restore`` method is asked through it (module docstring).

    Raises:
        ConfigError: the state dict is not a mapping, has a key that is not str/int, or two paths
            flatten to the same key.
    """
    check_state_dict(state_dict)
    fs = FlatState()
    fs.roots.append(_Root(state_dict))
    origin: dict[str, str] = {}

    def leaf(key_parts: tuple[PathKey, ...], root_index: int, path: tuple[PathKey, ...],
             value: Any) -> None:
        key = ".".join(str(p) for p in key_parts)
        shown = "/".join(repr(p) for p in key_parts)
        if key in fs.flat:
            raise ConfigError(
                f"state_dict paths {origin[key]} and {shown} both flatten to key {key!r}; "
                "rename one of them")
        fs.flat[key] = value
        fs.where[key] = (root_index, path)
        origin[key] = shown

    def walk(value: Any, key_parts: tuple[PathKey, ...], root_index: int,
             path: tuple[PathKey, ...], depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise ConfigError(f"state_dict is nested deeper than {_MAX_DEPTH} levels")
        if isinstance(value, _TENSORS):
            leaf(key_parts, root_index, path, value)
        elif isinstance(value, Stateful) and not isinstance(value, Mapping):
            for_restore = getattr(value, "state_dict_for_restore", None)
            if saved is not None and callable(for_restore):
                sd = for_restore(_saved_under(saved, ".".join(map(str, key_parts))))
            else:
                sd = value.state_dict()
            if not isinstance(sd, Mapping):
                raise ConfigError(
                    f"{type(value).__name__}.state_dict() at {'.'.join(map(str, key_parts))} "
                    f"returned {type(sd).__name__}, not a dict")
            fs.roots.append(_Root(sd, value))
            walk(sd, key_parts, len(fs.roots) - 1, (), depth + 1)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise ConfigError(
                        f"state_dict keys must be str or int; {'.'.join(map(str, key_parts))} "
                        f"has key {k!r} of type {type(k).__name__}")
                walk(v, (*key_parts, k), root_index, (*path, k), depth + 1)
        elif isinstance(value, (list, tuple)) and _holds_tensor(value):
            for i, v in enumerate(value):
                walk(v, (*key_parts, i), root_index, (*path, i), depth + 1)
        else:
            leaf(key_parts, root_index, path, value)

    for k, v in state_dict.items():
        if not isinstance(k, str):
            raise ConfigError(f"top-level state_dict keys must be str, got {k!r}")
        walk(v, (k,), 0, (k,), 1)
    return fs


def set_at_path(container: Any, path: tuple[PathKey, ...], value: Any) -> Any:
    """Set ``value`` at ``path`` inside ``container``; returns the (possibly rebuilt) container.

    Mappings and lists are updated in place; a tuple on the path is rebuilt.
    """
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(container, tuple):
        items = list(container)
        items[key] = set_at_path(items[key], rest, value)  # type: ignore[index]
        if type(container) is tuple:
            return tuple(items)
        return container._make(items)  # type: ignore[attr-defined]  # a namedtuple
    child = container[key]
    new_child = set_at_path(child, rest, value)
    if new_child is not child or not rest:
        container[key] = new_child
    return container
