"""Every ```python block in README.md and docs/ runs, so the docs cannot rot (use ```py for
fragments)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from _procs import Zygote

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)

BLOCKS = [(p.name, i, m.group(1)) for p in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
          for i, m in enumerate(BLOCK.finditer(p.read_text()))]


@pytest.mark.parametrize("name,index,code", BLOCKS, ids=[f"{n}#{i}" for n, i, _ in BLOCKS])
def test_doc_block_runs(name: str, index: int, code: str, tmp_path: Path,
                        zygote: Zygote) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CKPTMGR_PATH"}
    code = code.replace("/tmp/", f"{tmp_path}/")
    # As `python -c code` in a fresh process (forked with torch and ckptmgr already imported).
    out = zygote.run(code=code, timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 0, f"{name} block {index} failed:\n{out.stderr}"
