"""restore/save of something that is not a dict is a ConfigError before any I/O."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ckptmgr import (
    CheckpointManager,
    ConfigError,
)


@pytest.mark.parametrize("bad", [[1, 2], None, torch.zeros(3), "model"],
                         ids=["list", "None", "tensor", "str"])
def test_state_dict_that_is_not_a_dict_is_a_config_error_before_any_io(
        tmp_path: Path, bad: Any) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        calls: list[str] = []
        storage = mgr._durable.store.storage
        for name in ("read_bytes", "read_into", "open_reader", "list_files", "scan_root",
                     "size", "exists", "write_bytes", "open_writer"):
            method = getattr(storage, name)

            def counted(*args: Any, _name: str = name, _m: Any = method, **kw: Any) -> Any:
                calls.append(_name)
                return _m(*args, **kw)

            setattr(storage, name, counted)
        for call in (lambda: mgr.restore(1, bad), lambda: mgr.save(2, bad),
                     lambda: mgr.save_async(3, bad), lambda: mgr.save(5, bad, force=True)):
            with pytest.raises(ConfigError) as ei:
                call()
            assert type(bad).__name__ in str(ei.value) and "must be a dict" in str(ei.value)
        assert calls == []  # refused before any I/O
        assert mgr.all_steps() == [1]
