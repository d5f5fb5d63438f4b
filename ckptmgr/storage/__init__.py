"""Storage backends: the ``Storage`` protocol and its capabilities, local disk, and fsspec for
every other URL.

This package is the only place that imports fsspec. Backends are resolved lazily by URL scheme
through fsspec's registry; a missing one becomes :class:`BackendNotInstalledError` with the pip
extra to install.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from ckptmgr.errors import BackendNotInstalledError, ConfigError, StorageError
from ckptmgr.storage._retry import exception_chain, retry_budget, status_and_code
from ckptmgr.storage.base import (
    AtomicRename,
    RangeReader,
    RangeReads,
    RootEntry,
    Storage,
    StorageWriter,
    StreamReads,
    VectoredWriter,
    is_not_found,
    redact_url,
)
from ckptmgr.storage.fsspec_storage import FsspecStorage, prepare_url
from ckptmgr.storage.local import LocalStorage

__all__ = [
    "AtomicRename",
    "ClientConfig",
    "FsspecStorage",
    "LocalStorage",
    "RangeReader",
    "RangeReads",
    "RootEntry",
    "Storage",
    "StorageWriter",
    "StreamReads",
    "apply_client_config",
    "client_config",
    "VectoredWriter",
    "is_not_found",
    "is_url_supported",
    "lacks_credentials",
    "open_storage",
    "redact_url",
    "retry_budget",
    "split_scheme",
]

# The fsspec backend of each bucket scheme and the extra of our pyproject that installs it.
# ckptmgr is installed from a clone, not a registry: an error names the backend package (which
# is on PyPI) and the extra only as an editable install of the clone.
_BACKENDS = {"gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"), "s3": ("s3fs", "s3"),
             "s3a": ("s3fs", "s3")}


def lacks_credentials(e: BaseException) -> bool:
    """Whether ``e`` (or an error in its chain) says the store's client found no credentials
    (botocore's ``NoCredentialsError``) or the store refused an unauthenticated caller (HTTP 401,
    GCS's "Anonymous caller"): the fix is to pass credentials, not to retry."""
    for c in exception_chain(e):
        if type(c).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            return True
        status, _ = status_and_code(c)
        if status == 401 or "Anonymous caller" in str(c):
            return True
    return False


def _install_hint(scheme: str, error: str) -> str:
    backend = _BACKENDS.get(scheme)
    if backend is None:
        return f"install the package: {error}"
    package, extra = backend
    return f'pip install {package} (or, in a clone of ckptmgr: pip install -e ".[{extra}]")'


ClientConfig = dict[str, Any]
"""What another process needs to open a root as this one does: fsspec's configuration
(``fsspec.config.conf``: per protocol, the options its file systems get by default, set in code or
from fsspec's config files) and the file-system class registered in code for the root's scheme."""


def client_config(url: str) -> ClientConfig:
    """This process's fsspec configuration for ``url``, for another process to apply.

    Raises:
        ConfigError: the scheme's file system was registered in code with a class defined in the
            training script (``__main__``): another process cannot import it.
    """
    import copy

    import fsspec
    import fsspec.config

    impl = None
    scheme = split_scheme(url)[0]
    cls = fsspec.registry.get(scheme) if scheme else None
    if cls is not None:
        if cls.__module__ == "__main__":
            raise ConfigError(
                f"the {scheme}:// file system {cls.__qualname__} is defined in the training "
                "script (__main__), which the writer process cannot import: define it in an "
                "importable module, or use async_mode='thread'")
        impl = (scheme, f"{cls.__module__}.{cls.__qualname__}")
    return {"conf": copy.deepcopy(dict(fsspec.config.conf)), "impl": impl}


def apply_client_config(conf: ClientConfig) -> None:
    """Configure this process's fsspec file systems as ``conf`` (:func:`client_config`) says."""
    import fsspec
    import fsspec.config

    fsspec.config.conf.update(conf["conf"])
    if conf["impl"] is not None:
        fsspec.register_implementation(*conf["impl"], clobber=True)


def split_scheme(url: str) -> tuple[str | None, str]:
    """``(scheme, rest)``; scheme None for a plain path."""
    if "://" in url:
        scheme, rest = url.split("://", 1)
        return scheme.lower(), rest
    return None, url


class _NoTraceback(logging.Filter):
    """Keeps a record's message, drops its traceback: gcsfs logs a full aiohttp traceback for
    every retry of an unreachable endpoint. The failure still reaches the caller as StorageError
    with the backend's exception as ``__cause__``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            kind = record.exc_info[0].__name__ if record.exc_info[0] else "error"
            record.msg = f"{record.getMessage()} ({kind})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


_GCSFS_FILTER = _NoTraceback()


def _quiet_gcsfs_tracebacks() -> None:
    logger = logging.getLogger("gcsfs")
    if _GCSFS_FILTER not in logger.filters:
        logger.addFilter(_GCSFS_FILTER)


def _check_local_writable(root: str, shown: str) -> None:
    """Raise ConfigError when this process cannot create files in ``root`` (or, for a root not
    created yet, directories in the nearest existing directory above it)."""
    probe = os.path.abspath(root)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if os.access(probe, os.W_OK | os.X_OK):
        return
    try:
        read_only_fs = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        read_only_fs = False
    if read_only_fs:
        reason = "it is on a read-only file system"
    else:
        st = os.stat(probe)
        reason = (f"permission denied (mode {st.st_mode & 0o7777:04o}, owner uid {st.st_uid}; "
                  f"this process runs as uid {os.geteuid()})")
    where = "" if probe == os.path.abspath(root) else f" ({probe}, where it would be created)"
    raise ConfigError(f"checkpoint root {shown!r} cannot be written{where}: {reason}; pass a "
                      "writable path, or open it as a reader")


def is_url_supported(url: Any) -> bool:
    """Whether ``url`` names a place :func:`open_storage` can open: a non-empty local path,
    ``file://``, or a URL whose scheme fsspec knows (its backend may still be missing). No I/O;
    never raises (for DCP's ``validate_checkpoint_id``)."""
    if isinstance(url, os.PathLike):
        try:
            url = os.fspath(url)
        except TypeError:
            return False
    if not isinstance(url, str) or not url.strip() or "\x00" in url:
        return False
    scheme, rest = split_scheme(url)
    if scheme in (None, "file", "local"):
        return bool(rest)
    import fsspec

    return scheme in fsspec.available_protocols() or scheme in fsspec.registry


def open_storage(url: str, storage_options: Mapping[str, Any] | None = None, *,
                 writable: bool = True) -> Storage:
    """The Storage for ``url``: local paths and ``file://`` on POSIX calls, the rest via fsspec.

    Performs no writes. With ``writable`` (the default) a local root, or the nearest existing
    directory above a root not created yet, must be writable by this process; readers (a
    read-only manager, inspection tools) pass ``writable=False``.

    Raises:
        ConfigError: empty URL, a NUL byte in it, unknown scheme, credentials in a URL whose
            scheme cannot use them (``file://user:pass@``; not echoed), a root that is an
            existing file, or a local root that cannot be written (path and reason given).
        BackendNotInstalledError: the scheme is known but its package is not installed.
        StorageError: the backend could not be set up (bad credentials format, ...).
    """
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"path must be a non-empty string (a local path or URL), got {url!r}")
    shown = redact_url(url)
    if "\x00" in url:
        raise ConfigError(f"path {shown!r} contains a NUL byte, which no file system accepts")
    scheme, rest = split_scheme(url)
    opts = dict(storage_options or {})
    if scheme in (None, "file", "local"):
        if opts:
            raise ConfigError(
                f"storage_options {sorted(opts)} are not used by local paths; remove them")
        if scheme is not None and "@" in rest.split("/", 1)[0]:
            # file://user:pass@host/... would become a directory named after the password.
            raise ConfigError(
                f"{scheme}:// URLs cannot carry credentials ({shown!r}); local paths need none: "
                "remove the user:password@ part")
        if scheme is not None and rest.startswith("localhost/"):
            rest = rest[len("localhost"):]
        if not rest:
            raise ConfigError(f"path {shown!r} names no directory")
        storage = LocalStorage(rest, display_url=shown)
        if os.path.exists(storage.root) and not os.path.isdir(storage.root):
            raise ConfigError(
                f"path {shown!r} is an existing file; a checkpoint root must be a directory: "
                "give the directory that holds (or will hold) the step directories")
        if writable:
            _check_local_writable(storage.root, shown)
        return storage
    import fsspec  # here, not at import: local roots (and ``ckptmgr ls`` on them) skip it

    if scheme not in fsspec.available_protocols() and scheme not in fsspec.registry:
        raise ConfigError(
            f"unknown URL scheme {scheme!r} in {shown!r}; use a local path, file://, memory://, "
            "gs://, s3:// or another fsspec protocol")
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as e:
        hint = _install_hint(scheme, str(e))
        raise BackendNotInstalledError(
            f"no fsspec backend installed for {scheme}:// ({shown}); {hint}") from e
    # Credentials (options, URL user:password@, environment) are registered for redaction; an
    # s3 URL's key:secret@ moves into the options.
    url, opts = prepare_url(scheme, url, opts)
    if scheme in ("gs", "gcs"):
        _quiet_gcsfs_tracebacks()
    try:
        fs, root = fsspec.core.url_to_fs(url, **opts)
    except ImportError as e:
        hint = _install_hint(scheme, str(e))
        raise BackendNotInstalledError(
            f"no fsspec backend installed for {scheme}:// ({shown}); {hint}") from e
    except Exception as e:
        raise StorageError(f"could not set up storage for {shown}: {type(e).__name__}") from e
    storage_fs = FsspecStorage(fs, root, display_url=shown)
    # First, and once: an unreachable store fails here, within one call's retries (the clients
    # retry connection errors themselves), instead of in every call that follows.
    storage_fs.check_bucket()
    try:
        if fs.isfile(root):
            raise ConfigError(
                f"path {shown!r} is an existing file; a checkpoint root must be a directory: "
                "give the directory that holds (or will hold) the step directories")
    except ConfigError:
        raise
    except Exception:
        # The root may not be listable yet: the first save reports why.
        pass
    return storage_fs
