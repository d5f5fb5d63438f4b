"""safetensors: one dtype table serves the writer (export) and the reader (load_initial), so
every dtype export can write, load_initial reads back bit for bit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ckptmgr.dcp.tensor_bytes import tensor_memoryview
from ckptmgr.formats.safetensors import SAFETENSORS_DTYPES, read_safetensors, safetensors_header


@dataclass(frozen=True)
class _Out:
    key: str
    name: str
    shape: tuple[int, ...]
    out_dtype: torch.dtype

    @property
    def out_nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.out_dtype.itemsize


@pytest.mark.parametrize("code", sorted(SAFETENSORS_DTYPES))
def test_every_code_round_trips(tmp_path: Path, code: str) -> None:
    dtype = SAFETENSORS_DTYPES[code]
    raw = torch.arange(24, dtype=torch.uint8).repeat(dtype.itemsize)[:6 * dtype.itemsize]
    t = raw.view(dtype).reshape(2, 3)  # any bit pattern: the bytes are what must survive
    path = tmp_path / "w.safetensors"
    path.write_bytes(safetensors_header([_Out("w", "w", (2, 3), dtype)], step=1)
                     + bytes(tensor_memoryview(t.contiguous())))
    (back,) = read_safetensors(str(path))
    assert back.name == "w" and back.dtype == dtype and back.shape == (2, 3)
    assert bytes(tensor_memoryview(back.read())) == bytes(tensor_memoryview(t.contiguous()))


def test_fnuz_float8_is_in_the_table() -> None:
    assert SAFETENSORS_DTYPES["F8_E4M3FNUZ"] is torch.float8_e4m3fnuz
    assert SAFETENSORS_DTYPES["F8_E5M2FNUZ"] is torch.float8_e5m2fnuz
