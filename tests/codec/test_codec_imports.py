"""The codec reads untrusted bytes without torch or fsspec: importing it loads neither (even when
both are unavailable), and its dtype table names every dtype of the torch we run with."""

from __future__ import annotations

import subprocess
import sys

import torch

from ckptmgr.codec.dtypes import DTYPE_CANONICAL, DTYPE_ITEMSIZE

_MODULES = ("ckptmgr.codec", "ckptmgr.codec.checksum", "ckptmgr.codec.chunks",
            "ckptmgr.codec.dtypes", "ckptmgr.codec.layout", "ckptmgr.codec.manifest",
            "ckptmgr.codec.metadata", "ckptmgr.codec.metadata_columnar",
            "ckptmgr.codec.metadata_file", "ckptmgr.codec.metadata_json", "ckptmgr.codec.values")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_codec_imports_with_torch_and_fsspec_blocked() -> None:
    code = ("import sys\n"
            "for name in ('torch', 'fsspec'):\n"
            "    sys.modules[name] = None  # any import of them now raises ImportError\n"
            f"for m in {_MODULES!r}:\n"
            "    __import__(m)\n"
            "print('OK')\n")
    p = _run(code)
    assert p.returncode == 0 and p.stdout.strip() == "OK", p.stderr


def test_codec_import_loads_neither_torch_nor_fsspec() -> None:
    code = (f"import sys\nfor m in {_MODULES!r}:\n    __import__(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'fsspec')))\n")
    p = _run(code)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_dtype_table_covers_this_torch() -> None:
    names = {n: getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    assert {n: dt.itemsize for n, dt in names.items()} == dict(DTYPE_ITEMSIZE)


def test_dtype_aliases_are_named_as_this_torch_names_them() -> None:
    named = {n: str(getattr(torch, n)).removeprefix("torch.") for n in DTYPE_ITEMSIZE}
    assert {n: c for n, c in named.items() if c != n} == dict(DTYPE_CANONICAL)
