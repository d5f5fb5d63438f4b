"""Credentials never reach logs (backend loggers at DEBUG included), messages, repr() or manifests.

Secrets are planted in ``storage_options`` (moto accepts any key and secret) and in the URL's
``key:secret@`` part (SeaweedFS checks signatures, so there they are the real credentials, with
characters that must be percent-encoded).
"""

from __future__ import annotations

import logging
import traceback
import uuid
from typing import Any
from urllib.parse import quote

import pytest
import torch
from _servers import FaultProxy, MotoS3, SeaweedS3

from ckptmgr import CheckpointManager, CkptmgrError, StorageError
from ckptmgr.storage import open_storage

BUCKET = "ckpt-tests"
PLANTED_KEY = "AKIAPLANTEDKEY7777"
PLANTED_SECRET = "Planted/Secret+Value=9f8e7d6c5b4a"
LOGGERS = ("", "botocore", "aiobotocore", "s3fs", "gcsfs", "fsspec", "urllib3", "aiohttp",
           "ckptmgr")


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    for name in LOGGERS:
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


def _texts_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    return [formatter.format(r) for r in caplog.records]


def _exercise(url: str, opts: dict[str, Any]) -> list[str]:
    """Save, list, restore, retention and a few failures; the texts a user could see."""
    texts: list[str] = []
    with CheckpointManager(url, save_interval=1, max_to_keep=1, storage_options=opts) as mgr:
        texts += [repr(mgr), mgr.path]
        for s in (1, 2):
            mgr.save(s, {"w": torch.ones(100) * s, "extra": {"s": s}})
        info = mgr.step_info(2)
        texts += [repr(info), str(info)]
        for call in (lambda: mgr.restore(5, {"w": torch.zeros(100)}),
                     lambda: mgr.save(2, {"w": torch.ones(100)}, force=True),
                     lambda: mgr.restore(2, {"x": torch.zeros(100)})):
            with pytest.raises(CkptmgrError) as ei:
                call()
            texts += ["".join(traceback.format_exception(ei.value))]
        mgr.restore(2, {"w": torch.zeros(100), "extra": {"s": 0}})
        storage = mgr._durable.store.storage
        texts += [repr(storage), storage.url]
    return texts


def _objects(server: Any, url: str) -> list[str]:
    fs = server.fs()
    base = url.split("://", 1)[1]
    return [fs.cat_file(p).decode("utf-8", "replace") for p in fs.find(base)
            if p.endswith(".json")]


def _assert_clean(texts: list[str], *secrets: str) -> None:
    assert len(texts) > 20
    for text in texts:
        for secret in secrets:
            assert secret not in text, f"{secret!r} leaked in: {text[:2000]}"


def test_secrets_in_storage_options_never_leak(moto_s3: MotoS3,
                                               debug_logs: pytest.LogCaptureFixture) -> None:
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    opts = {"key": PLANTED_KEY, "secret": PLANTED_SECRET, "endpoint_url": moto_s3.endpoint_url,
            "client_kwargs": {"aws_session_token": "Planted-Session-Token-1234"}}
    texts = _exercise(url, opts)
    records = debug_logs.records
    # The test only means something if the backend really logged its requests at DEBUG.
    assert any(r.name.startswith("botocore") for r in records)
    assert any("Authorization" in r.getMessage() for r in records)
    texts += _texts_of(debug_logs) + _objects(moto_s3, url)
    _assert_clean(texts, PLANTED_KEY, PLANTED_SECRET, "Planted-Session-Token-1234")


def test_secrets_in_url_userinfo_never_leak(seaweed_s3: SeaweedS3,
                                            debug_logs: pytest.LogCaptureFixture) -> None:
    path = f"{BUCKET}/{uuid.uuid4().hex}"
    url = f"s3://{quote(seaweed_s3.key, safe='')}:{quote(seaweed_s3.secret, safe='')}@{path}"
    texts = _exercise(url, {"endpoint_url": seaweed_s3.endpoint_url})
    assert any("Authorization" in r.getMessage() for r in debug_logs.records)
    texts += _texts_of(debug_logs) + _objects(seaweed_s3, f"s3://{path}")
    _assert_clean(texts, seaweed_s3.key, seaweed_s3.secret, quote(seaweed_s3.secret, safe=""))


def test_secrets_never_in_storage_errors(seaweed_s3: SeaweedS3,
                                         debug_logs: pytest.LogCaptureFixture) -> None:
    wrong = "Wr0ng/Planted+Secret=abcdef123456"
    with pytest.raises(StorageError) as ei:  # refused: signature mismatch (the bucket check)
        open_storage(f"s3://{BUCKET}/{uuid.uuid4().hex}",
                     seaweed_s3.storage_options(secret=wrong))
    texts = ["".join(traceback.format_exception(ei.value)), *_texts_of(debug_logs)]
    _assert_clean(texts, wrong, seaweed_s3.key)


def test_secrets_never_in_retry_logs(moto_s3: MotoS3, debug_logs: pytest.LogCaptureFixture,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from _servers import S3_ERROR_BODIES, Fault

    from ckptmgr.storage import _retry

    monkeypatch.setattr(_retry, "DEFAULT_POLICY", _retry.RetryPolicy(
        max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.02))
    proxy = FaultProxy(moto_s3.endpoint_url)
    try:
        proxy.add(Fault(lambda m, p: m == "PUT", times=2, status=500,
                        body=S3_ERROR_BODIES[500]))
        url = f"s3://{PLANTED_KEY}:{quote(PLANTED_SECRET, safe='')}@{BUCKET}/{uuid.uuid4().hex}"
        st = open_storage(url, {"endpoint_url": proxy.url})
        st.write_bytes("1/f", b"x")
        assert st.read_bytes("1/f") == b"x"
    finally:
        proxy.stop()
    texts = [*_texts_of(debug_logs), repr(st), st.url]
    _assert_clean(texts, PLANTED_KEY, PLANTED_SECRET, quote(PLANTED_SECRET, safe=""))
