"""Reading untrusted local weight files: what every format reader of this package shares.

Only regular files are opened (symbolic links followed, as the Hugging Face hub cache needs; a
FIFO or device is refused, never waited on); JSON is parsed with repeated names refused; every
number taken from a file is checked before anything is allocated. A malformed file is
:class:`~ckptmgr.errors.ConfigError` naming it.
"""

from __future__ import annotations

import io
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ckptmgr.errors import ConfigError, StorageError

__all__ = ["INT64_MAX", "MAX_NDIM", "OutTensor", "SourceTensor", "bounded_numel", "nonneg_int",
           "open_regular", "parse_json", "read_exact", "short_repr"]

INT64_MAX = 2**63 - 1
MAX_NDIM = 64  # far above any model; bounds the work per shape before its product is formed


@dataclass
class SourceTensor:
    """One tensor of a weights file, read only when asked."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]


class OutTensor(Protocol):
    """One tensor as it goes into an output file (what the format writers need of it)."""

    @property
    def key(self) -> str:
        """Its flat key in the checkpoint (named in errors)."""

    @property
    def name(self) -> str:
        """Its name in the output file."""

    @property
    def shape(self) -> tuple[int, ...]:
        """Its shape."""

    @property
    def out_dtype(self) -> torch.dtype:
        """Its dtype in the output file."""

    @property
    def out_nbytes(self) -> int:
        """Its bytes in the output file."""


def open_regular(path: str, what: str) -> io.BufferedReader:
    """Open ``path`` for reading if it is a regular file, without ever blocking.

    Symbolic links are followed (the Hugging Face hub cache links every file of a snapshot to
    ``../../blobs/``); what they lead to must be a regular file. The open is non-blocking, so a
    FIFO or a device is refused by ``fstat`` instead of waiting for a writer that never comes.

    Raises:
        ConfigError: ``path`` is missing, unreadable, or not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as e:
        raise ConfigError(f"{what} {path!r} does not exist") from e
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        raise ConfigError(f"cannot open {what} {path!r}: {getattr(e, 'strerror', None) or e}"
                          ) from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise ConfigError(f"{what} {path!r} is {kind}; ckptmgr reads weights from regular "
                              "files only")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_exact(f: io.BufferedReader, path: str, buf: memoryview | bytearray, what: str) -> None:
    try:
        got = f.readinto(buf)
    except OSError as e:
        raise StorageError(f"reading {what} of {path!r} failed: {e.strerror or e}") from e
    if got != len(buf):
        raise ConfigError(f"{path} is truncated in {what} ({got} of {len(buf)} bytes); "
                          "copy the file again")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict; a name given twice is an error (json keeps the last silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the name {short_repr(k)} appears twice")
        out[k] = v
    return out


def parse_json(raw: bytes, path: str, what: str) -> Any:
    """The JSON document ``raw`` (UTF-8, no repeated keys), or ConfigError naming ``path``."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError too
        raise ConfigError(f"{path} is not a {what}: {e}") from e


def nonneg_int(value: Any) -> int | None:
    """``value`` if it is a non-negative JSON integer (never a bool or a float), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def bounded_numel(shape: tuple[int, ...], limit: int) -> int | None:
    """The element count of ``shape``, or None when the product of its non-zero sizes exceeds
    ``limit`` (checked as it is formed, so it never grows past ``limit`` times one size)."""
    n = 1
    for s in shape:
        if s:
            n *= s
            if n > limit:
                return None
    return 0 if 0 in shape else n


def short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
