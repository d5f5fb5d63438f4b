"""Credentials out of URLs before they reach logs, messages or ``repr()`` (pure)."""

from __future__ import annotations

import re

__all__ = ["redact_url"]

_USERINFO_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")
_QUERY_SECRET_RE = re.compile(r"([?&][^=&#]*(?:key|secret|token|password|sig|signature|credential)"
                              r"[^=&#]*=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` without a ``user:pass@`` part or secret-looking query values."""
    url = _USERINFO_RE.sub(r"\1***@", url)
    return _QUERY_SECRET_RE.sub(r"\1***", url)
