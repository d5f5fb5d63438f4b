"""Arguments of the standalone DCP writer and reader, checked at the boundary."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ckptmgr.errors import ConfigError

__all__ = ["check_options", "check_url"]


def check_url(url: Any, what: str) -> str | None:
    """``url`` as a str (paths and ``os.PathLike`` accepted), or None.

    Raises:
        ConfigError: anything else, or an empty string.
    """
    if url is None:
        return None
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"{what} must be a non-empty path or URL (str or os.PathLike), got "
                          f"{type(url).__name__}")
    return url


def check_options(options: Any, what: str) -> dict[str, Any]:
    """``options`` as a dict (None: empty).

    Raises:
        ConfigError: not a mapping with str keys.
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ConfigError(f"{what} must be a dict of fsspec options (str keys), got "
                          f"{type(options).__name__}")
    return dict(options)
