"""Keeping credentials out of logs, error messages, ``repr()`` and CLI output: the one place that
decides what is a secret and how it is hidden (pure: no torch, no fsspec).

Two kinds of secret are hidden:

- credentials *in URLs*, recognised by their shape wherever they appear: the ``user:password@``
  part and the values of secret-looking query parameters (``?token=...``, ``&sig=...``);
- credential *values* registered when a storage is opened or a command line is read: the
  ``storage_options`` entries that look secret, the ``user:password@`` part of the URL (and the
  secret query values), and the ``AWS_*``/Google/Azure credential variables of the environment.
  Values shorter than 4 characters are not registered (redacting them would mangle unrelated text).

From the first registration on, a log-record factory rewrites the records of the backend loggers
(``botocore``, ``s3fs``, ``gcsfs``, ``fsspec``, ``aiohttp``, ``urllib3``, ``google``, ...) and of
``ckptmgr``, so the message and a logged traceback carry ``***`` instead of a registered value,
whatever handler the application uses (backends log at DEBUG what they send: botocore every
request with its ``Authorization`` header, which names the access key). :func:`redact` hides
both kinds in any text (ckptmgr's error messages, ``repr()``, the CLI's output);
:func:`redact_url` hides the first kind in one URL.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import traceback
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl, unquote

__all__ = ["redact", "redact_url", "register", "register_options", "register_url"]

_MIN_LEN = 4
_SECRET_WORDS = "key|secret|token|password|sig|signature|credential"
"""Query parameter names that hold a secret (``X-Amz-Signature``, ``sas token``, ...)."""
_SECRET_KEY_RE = re.compile(
    r"key|secret|token|passw|credential|session|auth|private|sig|sas|account", re.IGNORECASE)
"""Option names whose values are secret (nested options and lists included)."""
_ENV_RE = re.compile(r"^(AWS_(ACCESS_KEY_ID|SECRET_ACCESS_KEY|SESSION_TOKEN|SECURITY_TOKEN)|"
                     r"GOOGLE_OAUTH_ACCESS_TOKEN|AZURE_STORAGE_(KEY|ACCOUNT_KEY|SAS_TOKEN|"
                     r"CONNECTION_STRING))$")
_LOGGERS = ("botocore", "aiobotocore", "boto3", "s3transfer", "s3fs", "gcsfs", "fsspec",
            "aiohttp", "urllib3", "requests", "google", "googleapiclient", "ckptmgr")

# Well-known option values that name a method, not a secret (gcsfs ``token="anon"``, ...).
_NOT_SECRETS = frozenset({"anon", "google_default", "cache", "cloud", "browser", "true", "false",
                          "none", "None", "True", "False"})

# One URL (the whole string is the URL).
_URL_USERINFO_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")
_URL_QUERY_SECRET_RE = re.compile(rf"([?&][^=&#]*(?:{_SECRET_WORDS})[^=&#]*=)[^&#]*",
                                  re.IGNORECASE)
# URLs inside free text: they end at whitespace or a quote.
_TEXT_USERINFO_RE = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s'\"]*@")
_TEXT_QUERY_SECRET_RE = re.compile(
    rf"([?&][^=&#\s]*(?:{_SECRET_WORDS})[^=&#\s]*=)[^&#\s'\"]*", re.IGNORECASE)

_lock = threading.Lock()
_secrets: frozenset[str] = frozenset()
_pattern: re.Pattern[str] | None = None
_installed = False


def redact_url(url: str) -> str:
    """``url`` without a ``user:pass@`` part or secret-looking query values."""
    url = _URL_USERINFO_RE.sub(r"\1***@", url)
    return _URL_QUERY_SECRET_RE.sub(r"\1***", url)


def redact(text: str) -> str:
    """``text`` with every registered secret, and every credential of a URL in it, as ``***``."""
    if not text:
        return text
    text = _redact_registered(text)
    text = _TEXT_USERINFO_RE.sub(r"\1***@", text)
    return _TEXT_QUERY_SECRET_RE.sub(r"\1***", text)


def _redact_registered(text: str) -> str:
    pattern = _pattern
    return pattern.sub("***", text) if pattern is not None and text else text


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
    """Register the secret-looking values of ``options`` (``storage_options``, ``-o KEY=VALUE``)
    and the credential variables of the environment."""
    values = list(_secret_values(options, False))
    for k, v in os.environ.items():
        if _ENV_RE.match(k):
            values.append(v)
    register(values)


def register_url(url: str) -> tuple[str | None, str | None]:
    """Register the credentials of ``url``: the ``user``, ``password`` and whole ``user:password``
    of ``scheme://user:password@host/...`` (as written and percent-decoded) and the values of its
    secret-looking query parameters.

    Returns:
        ``(user, password)`` percent-decoded, each None when absent.
    """
    values: list[str] = []
    _, sep, query = url.partition("?")
    if sep:
        values += [v for k, v in parse_qsl(query.partition("#")[0], keep_blank_values=True)
                   if re.search(_SECRET_WORDS, k, re.IGNORECASE)]
    m = re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://([^/@]*)@", url)
    if m is None:
        register(values)
        return None, None
    userinfo = m.group(1)
    raw_user, _, raw_pw = userinfo.partition(":")
    user, pw = unquote(raw_user), unquote(raw_pw)
    register([*values, userinfo, raw_user, raw_pw, user, pw])
    return (user or None), (pw or None)


def _redact_record(record: logging.LogRecord) -> None:
    try:
        msg = record.getMessage()
    except Exception:  # a malformed record is the logging module's to report, not ours
        return
    # Only the registered values: backends log every request's query string at DEBUG
    # (``max-keys=``, continuation tokens), which the URL shapes would mangle for nothing.
    clean = _redact_registered(msg)
    if clean != msg:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
        text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        # Formatters use exc_text as is when it is set: the traceback is shown redacted.
        record.exc_text = _redact_registered(text)


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
