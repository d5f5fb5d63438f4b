"""Keeping credentials out of logs and messages.

Backends log at DEBUG what they send (botocore logs every request with its ``Authorization``
header, which names the access key) and their exceptions can quote URLs. When a storage is opened,
the credential values it was given (``storage_options`` entries that look secret, the
``user:password@`` part of the URL, and the ``AWS_*`` credential variables of the environment) are
registered here, and from then on:

- :func:`redact` replaces them with ``***`` in any text (ckptmgr's own error messages use it);
- a log-record factory rewrites records of the backend loggers (``botocore``, ``s3fs``,
  ``gcsfs``, ``fsspec``, ``aiohttp``, ``urllib3``, ``google``, ...) and of ``ckptmgr`` so the
  message and a logged traceback carry ``***`` instead, whatever handler the application uses.

Values shorter than 4 characters are not registered (redacting them would mangle unrelated text).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import traceback
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import unquote

__all__ = ["redact", "register", "register_options", "register_url_userinfo"]

_MIN_LEN = 4
_SECRET_KEY_RE = re.compile(
    r"key|secret|token|passw|credential|session|auth|private|signature|sas|account", re.IGNORECASE)
_ENV_RE = re.compile(r"^(AWS_(ACCESS_KEY_ID|SECRET_ACCESS_KEY|SESSION_TOKEN|SECURITY_TOKEN)|"
                     r"GOOGLE_OAUTH_ACCESS_TOKEN|AZURE_STORAGE_(KEY|ACCOUNT_KEY|SAS_TOKEN|"
                     r"CONNECTION_STRING))$")
_LOGGERS = ("botocore", "aiobotocore", "boto3", "s3transfer", "s3fs", "gcsfs", "fsspec",
            "aiohttp", "urllib3", "requests", "google", "googleapiclient", "ckptmgr")

# Well-known option values that name a method, not a secret (gcsfs ``token="anon"``, ...).
_NOT_SECRETS = frozenset({"anon", "google_default", "cache", "cloud", "browser", "true", "false",
                          "none", "None", "True", "False"})

_lock = threading.Lock()
_secrets: frozenset[str] = frozenset()
_pattern: re.Pattern[str] | None = None
_installed = False


def register(values: Iterable[str]) -> None:
    """Treat each of ``values`` as a secret from now on (for this process)."""
    global _secrets, _pattern
    new = {v for v in values
           if isinstance(v, str) and len(v) >= _MIN_LEN and v not in _NOT_SECRETS}
    with _lock:
        if new <= _secrets:
            _install_locked()
            return
        _secrets = _secrets | new
        # Longest first, so a secret containing another is replaced whole.
        _pattern = re.compile("|".join(re.escape(s) for s in sorted(_secrets, key=len,
                                                                    reverse=True)))
        _install_locked()


def _secret_values(obj: Any, key_is_secret: bool) -> Iterable[str]:
    if isinstance(obj, str):
        if key_is_secret:
            yield obj
    elif isinstance(obj, bytes):
        if key_is_secret:
            yield obj.decode("utf-8", "replace")
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _secret_values(v, key_is_secret or bool(_SECRET_KEY_RE.search(str(k))))
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            yield from _secret_values(v, key_is_secret)
    else:
        # A credentials object (botocore Credentials, google Credentials): its public string
        # attributes that look secret.
        for attr in ("access_key", "secret_key", "token", "key", "secret"):
            value = getattr(obj, attr, None)
            if isinstance(value, str):
                yield value


def register_options(options: Mapping[str, Any]) -> None:
    """Register the secret-looking values of ``storage_options`` and of the environment."""
    values = list(_secret_values(options, False))
    for k, v in os.environ.items():
        if _ENV_RE.match(k):
            values.append(v)
    register(values)


def register_url_userinfo(url: str) -> tuple[str | None, str | None]:
    """Register the ``user`` and ``password`` of ``scheme://user:password@host/...``; return them
    (percent-decoded) or ``(None, None)`` when the URL has none."""
    m = re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://([^/@]*)@", url)
    if m is None:
        return None, None
    raw_user, _, raw_pw = m.group(1).partition(":")
    user, pw = unquote(raw_user), unquote(raw_pw)
    register([raw_user, raw_pw, user, pw])
    return (user or None), (pw or None)


def redact(text: str) -> str:
    """``text`` with every registered secret replaced by ``***``."""
    pattern = _pattern
    if pattern is None or not text:
        return text
    return pattern.sub("***", text)


def _redact_record(record: logging.LogRecord) -> None:
    pattern = _pattern
    if pattern is None:
        return
    try:
        msg = record.getMessage()
    except Exception:  # a malformed record is the logging module's to report, not ours
        return
    clean = pattern.sub("***", msg)
    if clean != msg:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
        text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        # Formatters use exc_text as is when it is set: the traceback is shown redacted.
        record.exc_text = pattern.sub("***", text)


def _install_locked() -> None:
    global _installed
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        name = record.name
        if _pattern is not None and name.startswith(_LOGGERS) and (
                name.split(".", 1)[0] in _LOGGERS):
            _redact_record(record)
        return record

    logging.setLogRecordFactory(factory)
    _installed = True
