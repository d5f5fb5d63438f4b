"""Names and paths inside a checkpoint root (pure: no torch, no fsspec).

Layout::

    <root>/<step>/                       one directory (prefix) per step, canonical decimal name
    <root>/<step>/data-<attempt>-r<rank>.bin    raw tensor bytes and encoded values of one rank
    <root>/<step>/metadata-<attempt>.json      DCP metadata encoded as JSON by our writer
    <root>/<step>/commit.json            the manifest; written last; its presence is the commit
    <root>/.tmp-<step>-<attempt>/        where a new step is written on storages that can rename
    <root>/chunks/<32 hex>               a shared tensor chunk (``reuse_unchanged=True``), named by
                                         the xxh3-128 hash of its bytes; steps reference it

``attempt`` is a fresh random token per save attempt, so a retried save or an overwrite never
touches the files that a committed manifest points to.

A shared chunk's path, ``chunks/<32 hex>``, is relative to the ROOT, not to a step directory: it is
the only path with a '/' that a manifest or metadata may name (:func:`check_stored_name`), and the
only one outside the step directory.
"""

from __future__ import annotations

import operator
import re
import secrets
from typing import Any

from ckptmgr.errors import ConfigError

__all__ = [
    "MANIFEST_NAME",
    "MAX_STEP",
    "SHARED_DIR",
    "STAGING_PREFIX",
    "attempt_in_name",
    "check_file_name",
    "check_relpath",
    "check_shared_chunk_path",
    "check_step",
    "check_stored_name",
    "data_file_name",
    "is_canonical_step_name",
    "is_shared_chunk_name",
    "is_shared_chunk_path",
    "is_shared_temp_name",
    "join",
    "metadata_file_name",
    "new_attempt_id",
    "parse_staging_name",
    "parse_step_name",
    "shared_chunk_digest",
    "shared_chunk_path",
    "shared_temp_path",
    "staging_dir_name",
    "step_dir_name",
]

MANIFEST_NAME = "commit.json"
STAGING_PREFIX = ".tmp-"
SHARED_DIR = "chunks"
"""The directory of the root that holds shared chunks (``reuse_unchanged=True``)."""

MAX_STEP = 2**63 - 1
"""The largest step: every step must fit a signed 64-bit integer (19 decimal digits), so that it
can be listed back from its directory name and broadcast between ranks."""

_STEP_RE = re.compile(r"(?:0|[1-9][0-9]{0,18})")
_ATTEMPT_RE = re.compile(r"[0-9a-f]{12}")
_STAGING_RE = re.compile(r"\.tmp-(0|[1-9][0-9]{0,18})-([0-9a-f]{12})")
_ATTEMPT_IN_NAME_RE = re.compile(r"-([0-9a-f]{12})[-.]")
_DIGEST_RE = re.compile(r"[0-9a-f]{32}")
_SHARED_PATH_RE = re.compile(SHARED_DIR + r"/([0-9a-f]{32})")
_SHARED_TEMP_RE = re.compile(r"[0-9a-f]{32}\.tmp-[0-9a-f]{12}")


def new_attempt_id() -> str:
    """A fresh 12-hex-digit token naming one save attempt."""
    return secrets.token_hex(6)


def attempt_in_name(name: str | None) -> str | None:
    """The attempt id in one of our file names (``metadata-<id>.json``, ``data-<id>-...``)."""
    m = _ATTEMPT_IN_NAME_RE.search(name or "")
    return m.group(1) if m else None


def check_step(step: Any, what: str = "step") -> int:
    """``step`` as an int: any integral number (int, ``numpy.int64``, a one-element integer
    tensor, ``numbers.Integral``) from 0 to :data:`MAX_STEP`; never a bool.

    Raises:
        ConfigError: anything else (names the value and the rule).
    """
    rule = f"{what} must be an integer from 0 to {MAX_STEP} (not a bool)"
    dtype = getattr(step, "dtype", None)
    if isinstance(step, bool) or type(step).__name__ == "bool_" or str(dtype) in (
            "bool", "torch.bool"):
        raise ConfigError(f"{rule}, got {step!r} ({type(step).__name__})")
    try:
        value = operator.index(step)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"{rule}, got {step!r} ({type(step).__name__})") from e
    if not 0 <= value <= MAX_STEP:
        raise ConfigError(f"{rule}, got {value}")
    return int(value)


def step_dir_name(step: int) -> str:
    """The directory name of ``step``: its canonical decimal form."""
    return str(step)


def is_canonical_step_name(name: str) -> bool:
    """Whether ``name`` is a canonical decimal step name (no sign, no leading zeros, at most
    :data:`MAX_STEP`: 19 digits alone would let 9999999999999999999 through)."""
    return _STEP_RE.fullmatch(name) is not None and int(name) <= MAX_STEP


def parse_step_name(name: str) -> int | None:
    """The step a directory name stands for, or None if it is not a canonical step name."""
    return int(name) if is_canonical_step_name(name) else None


def staging_dir_name(step: int, attempt: str) -> str:
    """The temporary directory a new step is written into before it is renamed into place."""
    if _ATTEMPT_RE.fullmatch(attempt) is None:
        raise ValueError(f"attempt id must be 12 lowercase hex digits, got {attempt!r}")
    return f"{STAGING_PREFIX}{step}-{attempt}"


def parse_staging_name(name: str) -> tuple[int, str] | None:
    """``(step, attempt)`` for a staging directory name, else None."""
    m = _STAGING_RE.fullmatch(name)
    if m is None or int(m.group(1)) > MAX_STEP:
        return None
    return int(m.group(1)), m.group(2)


def data_file_name(attempt: str, rank: int, index: int = 0) -> str:
    """The name of data file ``index`` written by ``rank`` in ``attempt``."""
    return f"data-{attempt}-r{rank:05d}-{index:03d}.bin"


def metadata_file_name(attempt: str) -> str:
    """The name of the JSON-encoded DCP metadata file of ``attempt``."""
    return f"metadata-{attempt}.json"


def shared_chunk_path(digest: str) -> str:
    """The root-relative path of the shared chunk whose bytes hash to ``digest`` (32 lowercase
    hex digits of their xxh3-128)."""
    if _DIGEST_RE.fullmatch(digest) is None:
        raise ValueError(f"chunk digest must be 32 lowercase hex digits, got {digest!r}")
    return f"{SHARED_DIR}/{digest}"


def shared_temp_path(digest: str, token: str) -> str:
    """Where a rank writes shared chunk ``digest`` before renaming it into place (``token``: 12
    hex digits, fresh per write): a leftover of a crash is never mistaken for a chunk."""
    return f"{shared_chunk_path(digest)}.tmp-{token}"


def is_shared_chunk_path(path: str) -> bool:
    """Whether ``path`` is exactly a shared chunk's root-relative path, ``chunks/<32 hex>``."""
    return isinstance(path, str) and _SHARED_PATH_RE.fullmatch(path) is not None


def shared_chunk_digest(path: str) -> str:
    """The digest a shared chunk path names (``chunks/<hex>`` -> ``<hex>``)."""
    m = _SHARED_PATH_RE.fullmatch(path)
    if m is None:
        raise ValueError(f"not a shared chunk path: {path!r}")
    return m.group(1)


def is_shared_chunk_name(name: str) -> bool:
    """Whether ``name`` (a file name inside ``chunks/``) is a shared chunk's: 32 hex digits."""
    return _DIGEST_RE.fullmatch(name) is not None


def is_shared_temp_name(name: str) -> bool:
    """Whether ``name`` (inside ``chunks/``) is a shared chunk being written (or a crash's
    leftover of one): ``<32 hex>.tmp-<12 hex>``."""
    return _SHARED_TEMP_RE.fullmatch(name) is not None


def check_shared_chunk_path(path: str) -> str:
    """Return ``path`` if it is exactly ``chunks/<32 lowercase hex>``.

    Raises:
        ValueError: anything else.
    """
    if not is_shared_chunk_path(path):
        raise ValueError(f"a path outside the step directory must be a shared chunk, "
                         f"'{SHARED_DIR}/<32 lowercase hex>', got {path!r}"[:300])
    return path


def check_stored_name(name: str) -> str:
    """Return ``name`` if a metadata file may store bytes there: a file directly inside the step
    directory (:func:`check_file_name`), or a shared chunk of the root (``chunks/<32 hex>``, the
    only path outside the step directory anything may name).

    Raises:
        ValueError: anything else.
    """
    if isinstance(name, str) and is_shared_chunk_path(name):
        return name
    return check_file_name(name)


def check_relpath(path: str) -> str:
    """Return ``path`` if it is a plain relative path that stays inside its directory.

    Raises:
        ValueError: for an empty, absolute, backslashed or ``..``-containing path.
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"path must be a non-empty string, got {path!r}")
    if path.startswith("/") or "\\" in path or "\x00" in path or ":" in path:
        raise ValueError(f"path must be relative and plain, got {path!r}")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"path must not contain empty, '.' or '..' parts, got {path!r}")
    return path


def check_file_name(name: str) -> str:
    """Return ``name`` if it names a file directly inside the step directory.

    ckptmgr writes every file of a step at its top level, so a name with a '/' is never ours; a
    sub-directory could be a symbolic link out of the step, which opening with O_NOFOLLOW would
    not catch (it guards the last part only).

    Raises:
        ValueError: for anything :func:`check_relpath` rejects, or a name with a '/'.
    """
    check_relpath(name)
    if "/" in name:
        raise ValueError(f"path must name a file directly in the step directory, got {name!r}")
    return name


def join(*parts: str) -> str:
    """Join relative path parts with '/', skipping empty ones (never os.path: URLs need '/')."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))
