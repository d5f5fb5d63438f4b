"""The commit manifest (``<step>/commit.json``): its fields, encoding and validation (pure).

The manifest is written last by the coordinator; a step is committed exactly when it exists. It is
parsed defensively: size and nesting are bounded before JSON parsing allocates anything large, every
field is type-checked, and every path it names must stay inside the step directory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ckptmgr.codec.layout import MAX_STEP, check_file_name, check_shared_chunk_path
from ckptmgr.errors import ConfigError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FORMAT_VERSIONS",
    "MAX_MANIFEST_BYTES",
    "SHARED_FORMAT_VERSION",
    "FileEntry",
    "Manifest",
    "ManifestError",
    "UnsafePathError",
    "check_json_depth",
    "check_metadata",
    "check_metrics",
    "decode_manifest",
    "encode_manifest",
    "utc_now_iso",
]

FORMAT_NAME = "ckptmgr"
FORMAT_VERSION = 1
"""The version of a manifest without shared chunks (every step written with reuse off)."""
SHARED_FORMAT_VERSION = 2
"""The version of a manifest that references shared chunks (``shared``): older ckptmgr versions
refuse it with "upgrade ckptmgr" instead of failing on a path outside the step directory."""
FORMAT_VERSIONS = (FORMAT_VERSION, SHARED_FORMAT_VERSION)
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MAX_JSON_DEPTH = 64
_CHECKSUM_RE = re.compile(r"xxh3_64:[0-9a-f]{16}")
_ATTEMPT_RE = re.compile(r"[0-9a-f]{12}")  # layout.new_attempt_id: names files and directories
_RANK_RE = re.compile(r"0|[1-9][0-9]{0,9}")
_MAX_BYTES = (1 << 63) - 1  # sizes are read and compared as int64 by storage and torch
_MAX_RANKS = (1 << 31) - 1  # torch.distributed's ranks and world sizes are int32


class ManifestError(ValueError):
    """The manifest bytes are not a valid ckptmgr manifest (the caller wraps it with the step)."""


class UnsafePathError(ManifestError):
    """A path in a manifest or in metadata would leave the step directory (the caller raises
    UnsafeCheckpointError, not CorruptCheckpointError)."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a step: path relative to the step directory, size in bytes, checksum."""

    path: str
    size: int
    checksum: str


@dataclass(frozen=True)
class Manifest:
    """Everything the commit of one step records.

    ``files`` are the step's own files (inside its directory); ``shared`` the shared chunks it
    references (root-relative ``chunks/<32 hex>``, format version 2 only), each of which it needs
    as much as its own files.
    """

    step: int
    time: str
    attempt: str
    world_size: int
    metadata_file: str
    files: tuple[FileEntry, ...]
    bytes_per_rank: Mapping[int, int]
    versions: Mapping[str, str]
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    mesh: Any = None
    byteorder: str = "little"
    format_version: int = FORMAT_VERSION
    shared: tuple[FileEntry, ...] = ()
    # path -> entry: a restore looks up every file it reads, and a manifest may list 100k files.
    _by_path: dict[str, FileEntry] = field(init=False, repr=False, compare=False,
                                           default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_path", {f.path: f for f in (*self.files, *self.shared)})

    @property
    def total_bytes(self) -> int:
        """Bytes of the step's own files (in its directory), metadata included."""
        return sum(f.size for f in self.files)

    @property
    def shared_bytes(self) -> int:
        """Bytes of the shared chunks the step references (stored once under ``chunks/``)."""
        return sum(f.size for f in self.shared)

    @property
    def unix_time(self) -> float:
        """The commit time as seconds since the epoch."""
        return datetime.fromisoformat(self.time.replace("Z", "+00:00")).timestamp()

    def file(self, path: str) -> FileEntry:
        """The entry for ``path`` (a file of the step, or a shared chunk ``chunks/<hex>``);
        KeyError if the manifest does not list it."""
        return self._by_path[path]


def check_metrics(metrics: Any) -> dict[str, float]:
    """The ``metrics`` of a save as a plain dict of str -> float (one-element tensors and numpy
    scalars are read with ``.item()``).

    Raises:
        ConfigError: not a mapping of str to numbers (bools are not numbers here).
    """
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"metrics must be a dict of str -> number, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise ConfigError(f"metrics keys must be str, got {k!r}")
        if not isinstance(v, (int, float)) and callable(getattr(v, "item", None)):
            size = getattr(v, "size", 1)
            numel = getattr(v, "numel", None)
            if (numel() if callable(numel) else size) == 1:
                v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"metrics[{k!r}] must be a number, got {v!r}")
        out[k] = float(v)
    return out


def check_metadata(metadata: Any) -> dict[str, Any]:
    """The ``metadata`` of a save as a plain dict of JSON values.

    Raises:
        ConfigError: not a mapping with str keys of JSON-serializable values (no NaN).
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise ConfigError("metadata must be a dict with str keys of JSON values")
    try:
        json.dumps(dict(metadata), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"metadata must be JSON-serializable (no NaN): {e}") from e
    return dict(metadata)


def utc_now_iso() -> str:
    """Now, UTC, ISO 8601 with microseconds and a 'Z' suffix."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def encode_manifest(m: Manifest) -> bytes:
    """The manifest as UTF-8 JSON bytes."""
    doc = {
        "format": FORMAT_NAME,
        "format_version": m.format_version,
        "step": m.step,
        "time": m.time,
        "attempt": m.attempt,
        "world_size": m.world_size,
        "mesh": m.mesh,
        "byteorder": m.byteorder,
        "versions": dict(m.versions),
        "metrics": dict(m.metrics),
        "metadata": dict(m.metadata),
        "metadata_file": m.metadata_file,
        "files": [{"path": f.path, "size": f.size, "checksum": f.checksum} for f in m.files],
        "bytes_per_rank": {str(r): b for r, b in sorted(m.bytes_per_rank.items())},
        "total_bytes": m.total_bytes,
    }
    if m.format_version >= SHARED_FORMAT_VERSION:
        doc["shared"] = [{"path": f.path, "size": f.size, "checksum": f.checksum}
                         for f in m.shared]
        doc["shared_bytes"] = m.shared_bytes
    return json.dumps(doc, indent=1, sort_keys=False, allow_nan=True).encode("utf-8")


# A JSON string, escapes included (its brackets are not structure). An unterminated one runs to the
# end, as in the parser. It matches at every quote, and its loop is unambiguous: no backtracking.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
# Keeps only brackets, as "(" and ")": the depth does not depend on their kind.
_BRACKETS = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_FAST_DEPTH_BYTES = 1 << 20


def check_json_depth(data: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Reject JSON nested deeper than ``limit`` before parsing it (the parser recurses).

    Exact for well-formed JSON; malformed input (unbalanced brackets) may be rejected at a lower
    depth, never accepted deeper. Up to 1 MiB (every manifest, the metadata of some thousands of
    tensors) it runs at C speed: strings are cut out (by splitting at quotes when there is no
    backslash), the brackets kept, then each pass deletes every innermost pair, one nesting level
    per pass. Those copies would take a few times the input's size, so larger input is scanned
    byte by byte, allocating nothing.
    """
    if len(data) > _FAST_DEPTH_BYTES:
        _scan_json_depth(data, limit)
        return
    outside = _JSON_STRING.sub(b"", data) if b"\\" in data else b"".join(data.split(b'"')[::2])
    brackets = outside.translate(_BRACKETS, _NOT_BRACKETS)
    levels = 0
    while b"()" in brackets:
        levels += 1
        if levels > limit:
            raise ManifestError(f"JSON is nested deeper than {limit} levels")
        brackets = brackets.replace(b"()", b"")
    # Left: unmatched brackets, ")" * k + "(" * m; each opener can add a level.
    if levels + brackets.count(b"(") > limit:
        raise ManifestError(f"JSON is nested deeper than {limit} levels")


def _scan_json_depth(data: bytes, limit: int) -> None:
    depth = 0
    in_str = False
    escape = False
    for byte in data:
        if in_str:
            if escape:
                escape = False
            elif byte == 0x5C:  # backslash
                escape = True
            elif byte == 0x22:  # quote
                in_str = False
        elif byte == 0x22:
            in_str = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                raise ManifestError(f"JSON is nested deeper than {limit} levels")
        elif byte in (0x5D, 0x7D):
            depth -= 1


def _req(doc: Mapping[str, Any], key: str, typ: type | tuple[type, ...]) -> Any:
    if key not in doc:
        raise ManifestError(f"manifest lacks field {key!r}")
    value = doc[key]
    if isinstance(value, bool) and typ is not bool and (typ is int or typ is float):
        raise ManifestError(f"manifest field {key!r} must be {typ}, got {value!r}")
    if not isinstance(value, typ):
        raise ManifestError(f"manifest field {key!r} has the wrong type: {type(value).__name__}")
    return value


def _nonneg_int(value: Any, what: str, most: int = _MAX_BYTES) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise ManifestError(f"{what} must be an int from 0 to {most}, got {value!r}"[:300])
    return value


def decode_manifest(data: bytes, *, expected_step: int | None = None) -> Manifest:
    """Parse and validate manifest bytes.

    Raises:
        ManifestError: oversized, too deep, not JSON, wrong format or version, a bad field, a path
            that escapes the step directory, or a step that differs from ``expected_step``.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} limit")
    check_json_depth(data)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # ValueError: also ints of over 4300 digits
        raise ManifestError(f"manifest is not valid JSON: {e}"[:300]) from e
    if not isinstance(doc, dict):
        raise ManifestError("manifest is not a JSON object")
    if doc.get("format") != FORMAT_NAME:
        raise ManifestError(f"not a ckptmgr manifest (format={doc.get('format')!r})")
    version = _req(doc, "format_version", int)
    if version not in FORMAT_VERSIONS:
        raise ManifestError(
            f"manifest format_version {version} is not supported by this ckptmgr "
            f"(supports {', '.join(map(str, FORMAT_VERSIONS))}); upgrade ckptmgr"[:300])
    step = _nonneg_int(_req(doc, "step", int), "step", MAX_STEP)
    if expected_step is not None and step != expected_step:
        raise ManifestError(f"manifest names step {step} but lives in directory {expected_step}")
    time = _req(doc, "time", str)
    try:
        # As Manifest.unix_time reads it: a time near year 1 or 9999 can overflow there.
        datetime.fromisoformat(time.replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError, OSError) as e:
        raise ManifestError(f"manifest time {time!r} is not an ISO 8601 time"[:300]) from e
    attempt = _req(doc, "attempt", str)
    if not _ATTEMPT_RE.fullmatch(attempt):
        raise ManifestError(f"manifest attempt {attempt!r} is not 12 hex digits"[:300])
    world_size = _nonneg_int(_req(doc, "world_size", int), "world_size", _MAX_RANKS)
    byteorder = doc.get("byteorder", "little")
    if byteorder not in ("little", "big"):
        raise ManifestError(f"byteorder must be 'little' or 'big', got {byteorder!r}")
    try:
        metadata_file = check_file_name(_req(doc, "metadata_file", str))
    except ValueError as e:
        raise UnsafePathError(f"metadata_file escapes the step directory: {e}") from e
    seen: set[str] = set()
    files = _file_entries(_req(doc, "files", list), "files", seen)
    shared: list[FileEntry] = []
    if version >= SHARED_FORMAT_VERSION:
        shared = _file_entries(_req(doc, "shared", list), "shared", seen)
        total_shared = doc.get("shared_bytes")
        if total_shared is not None and total_shared != sum(f.size for f in shared):
            raise ManifestError(f"shared_bytes {total_shared!r} does not match the sum of the "
                                "shared chunks' sizes"[:300])
    elif "shared" in doc:
        raise ManifestError(f"manifest format_version {version} cannot list shared chunks "
                            f"(format_version {SHARED_FORMAT_VERSION} does)")
    if metadata_file not in seen:
        raise ManifestError(f"metadata_file {metadata_file!r} is not listed in files")
    bpr_raw = _req(doc, "bytes_per_rank", dict)
    bytes_per_rank: dict[int, int] = {}
    for k, v in bpr_raw.items():
        # Not str.isdigit: it accepts digits int() refuses ("²") and any number of them.
        if not (isinstance(k, str) and _RANK_RE.fullmatch(k)) or int(k) > _MAX_RANKS:
            raise ManifestError(f"bytes_per_rank key {k!r} is not a rank"[:300])
        bytes_per_rank[int(k)] = _nonneg_int(v, f"bytes_per_rank[{k}]")
    versions = _req(doc, "versions", dict)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in versions.items()):
        raise ManifestError("versions must map names to version strings")
    metrics = _req(doc, "metrics", dict)
    floats: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ManifestError(f"metrics[{k!r}] must be a number, got {v!r}"[:300])
        try:
            floats[k] = float(v)  # NaN and infinities are fine (a diverged loss)
        except OverflowError as e:
            raise ManifestError(f"metrics[{k!r}] is too large for a float"[:300]) from e
    metadata = _req(doc, "metadata", dict)
    total = doc.get("total_bytes")
    if total is not None and total != sum(f.size for f in files):
        raise ManifestError(f"total_bytes {total!r} does not match the sum of file sizes")
    return Manifest(
        step=step, time=time, attempt=attempt, world_size=world_size,
        metadata_file=metadata_file, files=tuple(files), bytes_per_rank=bytes_per_rank,
        versions=dict(versions), metrics=floats,
        metadata=metadata, mesh=doc.get("mesh"), byteorder=byteorder, format_version=version,
        shared=tuple(shared),
    )


def _file_entries(raw: list[Any], what: str, seen: set[str]) -> list[FileEntry]:
    """The entries of ``files`` (names inside the step directory) or ``shared`` (exactly
    ``chunks/<32 hex>``, root-relative); ``seen`` collects paths across both lists."""
    out: list[FileEntry] = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise ManifestError(f"{what}[{i}] is not an object")
        try:
            if what == "shared":
                path = check_shared_chunk_path(_req(entry, "path", str))
            else:
                path = check_file_name(_req(entry, "path", str))
        except ValueError as e:
            raise UnsafePathError(f"{what}[{i}] escapes the step directory: {e}") from e
        if path in seen:
            raise ManifestError(f"{what}[{i}] lists {path!r} twice"[:300])
        seen.add(path)
        size = _nonneg_int(_req(entry, "size", int), f"{what}[{i}].size")
        checksum = _req(entry, "checksum", str)
        if not _CHECKSUM_RE.fullmatch(checksum):
            raise ManifestError(f"{what}[{i}].checksum {checksum!r} is not "
                                "'xxh3_64:<16 hex>'"[:300])
        out.append(FileEntry(path, size, checksum))
    return out
