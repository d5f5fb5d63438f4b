"""CheckpointManager on local paths, file:// and memory://: round trips, commit, errors."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptmgr
from ckptmgr import (
    CheckpointExistsError,
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    IncompleteCheckpointError,
    StateMismatchError,
    UnsafeCheckpointError,
)
from ckptmgr.lease import LEASE_NAME


class Counter:
    """A user Stateful object."""

    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.hist: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "hist": list(self.hist), "t": torch.full((2,), float(self.n))}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = sd["n"]
        self.hist = list(sd["hist"])
        assert torch.equal(sd["t"], torch.full((2,), float(self.n)))


def all_dtypes_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).to(torch.float16),
        "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "i64": torch.randint(-(2**40), 2**40, (6,), generator=g),
        "i32": torch.randint(-100, 100, (3, 3), generator=g, dtype=torch.int32),
        "u8": torch.randint(0, 255, (11,), generator=g, dtype=torch.uint8),
        "i8": torch.randint(-100, 100, (4,), generator=g, dtype=torch.int8),
        "bool": torch.randint(0, 2, (8,), generator=g).bool(),
        "scalar": torch.tensor(float(seed) + 0.5),
        "iscalar": torch.tensor(seed),
        "empty": torch.empty(0, 3),
        "nested": {"a": {"b": torch.randn(4, generator=g), "c": [torch.ones(2) * seed, 3]}},
        "noncontig": torch.randn(4, 6, generator=g).t(),
        "py": {"none": None, "b": True, "i": seed, "f": 0.1 * seed, "s": "héllo",
               "l": [1, [2, "x"]], "t": (1, (2.5, None)), "d": {1: "one", "k": [None]},
               "nan": float("nan"), "neg0": -0.0, "big": 2**70, "bytes": b"\x00\xff",
               "od": OrderedDict(z=1, a=2)},
    }


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    def z(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v.contiguous()) if v.is_contiguous() else torch.zeros_like(v)
        if isinstance(v, dict):
            return type(v)((k, z(x)) for k, x in v.items())
        if isinstance(v, list):
            return [z(x) for x in v]
        return None

    return {k: z(v) for k, v in state.items()}


def assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        if a.numel():
            assert torch.equal(a.contiguous().view(-1).view(torch.uint8),
                               b.contiguous().view(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, path
    else:
        assert type(a) is type(b) and a == b, path
        if isinstance(a, float):
            assert str(a) == str(b), path  # -0.0 stays -0.0


def test_round_trip_every_dtype_and_python_values(root: str) -> None:
    state = all_dtypes_state(3)
    with CheckpointManager(root, save_interval=1) as mgr:
        assert mgr.save(3, state) is True
        assert mgr.all_steps() == [3]
    with CheckpointManager(root, save_interval=1) as mgr:
        target = zeros_like_state(state)
        mgr.restore(3, target)
    assert_same(state, target)


def test_model_optimizer_stateful_round_trip(root: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    counter = Counter(5)
    counter.hist = [1, 2]
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    state = {"model": model, "optim": opt, "sched": sched, "counter": counter}
    with CheckpointManager(root, save_interval=10) as mgr:
        mgr.save(10, state)
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    counter2 = Counter()
    ckptmgr.prime_optimizer(opt2)
    with CheckpointManager(root, save_interval=10) as mgr:
        mgr.restore(max(mgr.all_steps()),
                    {"model": model2, "optim": opt2, "sched": sched2, "counter": counter2})
    assert_same(model.state_dict(), model2.state_dict())
    assert_same(opt.state_dict(), opt2.state_dict())
    assert sched.state_dict() == sched2.state_dict()
    assert (counter2.n, counter2.hist) == (5, [1, 2])
    x = torch.randn(4, 8)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).pow(2).mean().backward()
        o.step()
    assert_same(model.state_dict(), model2.state_dict())


def test_should_save_interval_and_force(local_root: str) -> None:
    mgr = CheckpointManager(local_root, save_interval=5)
    st = {"w": torch.ones(2)}
    assert [s for s in range(12) if mgr.should_save(s)] == [0, 5, 10]
    saved = [s for s in range(1, 12) if mgr.save_async(s, st)]
    assert saved == [5, 10]
    assert mgr.save(7, st, force=True) is True
    mgr.join()
    assert mgr.all_steps() == [5, 7, 10]
    assert mgr.latest_step() == 10
    mgr.close()
    mgr.close()  # idempotent


def test_committed_step_is_never_written_into(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=1) as mgr:
        mgr.save(1, {"w": torch.ones(3)})
        assert mgr.save(1, {"w": torch.zeros(3)}) is False  # due: skipped with a warning
        with pytest.raises(CheckpointExistsError, match="overwrite=True"):
            mgr.save(1, {"w": torch.zeros(3)}, force=True)
        out = {"w": torch.empty(3)}
        mgr.restore(1, out)
        assert torch.equal(out["w"], torch.ones(3))


def test_overwrite_replaces_atomically(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=1, overwrite=True) as mgr:
        mgr.save(1, {"w": torch.ones(3)})
        mgr.save(1, {"w": torch.full((3,), 2.0)})
        out = {"w": torch.empty(3)}
        mgr.restore(1, out)
        assert torch.equal(out["w"], torch.full((3,), 2.0))
        files = sorted(os.listdir(os.path.join(local_root, "1")))
        assert len(files) == 3, files  # old attempt's files are gone


def test_step_info(root: str) -> None:
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(4, {"w": torch.ones(1000)}, metrics={"loss": 0.25}, metadata={"run": "a"})
        info = mgr.step_info(4)
    assert info.step == 4 and info.world_size == 1
    assert info.metrics == {"loss": 0.25} and info.metadata == {"run": "a"}
    assert info.time.endswith("Z") and info.time.startswith("20")
    assert info.total_bytes == sum(f.size for f in info.files) >= 4000
    assert info.bytes_per_rank[0] == info.total_bytes
    assert info.versions["torch"] == torch.__version__
    assert info.versions["ckptmgr"] == ckptmgr.__version__
    assert all(f.checksum.startswith("xxh3_64:") for f in info.files)
    with pytest.raises(AttributeError):
        info.step = 5  # type: ignore[misc]


def test_subset_restore_and_missing_keys(root: str) -> None:
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, {"model": {"w": torch.ones(2)}, "optim": {"m": torch.ones(2)}})
        only = {"model": {"w": torch.zeros(2)}}
        mgr.restore(1, only)
        assert torch.equal(only["model"]["w"], torch.ones(2))
        extra = {"model": {"w": torch.zeros(2), "new": torch.zeros(1)}, "epoch": 0}
        with pytest.raises(StateMismatchError) as ei:
            mgr.restore(1, extra)
        assert "model.new" in str(ei.value) and "epoch" in str(ei.value)
        assert sorted(ei.value.missing) == ["epoch", "model.new"]
        mgr.restore(1, extra, allow_partial=True)
        assert torch.equal(extra["model"]["w"], torch.ones(2)) and extra["epoch"] == 0


def test_shape_and_dtype_mismatch_listed(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=1) as mgr:
        mgr.save(1, {"a": torch.ones(2, 3), "b": torch.ones(4), "c": torch.ones(1)})
        target = {"a": torch.zeros(3, 2), "b": torch.zeros(4, dtype=torch.float64),
                  "c": torch.zeros(1)}
        with pytest.raises(StateMismatchError) as ei:
            mgr.restore(1, target)
        msg = str(ei.value)
        assert "a: shape [2, 3]" in msg and "b: dtype float32" in msg
        assert len(ei.value.mismatches) == 2
        assert torch.equal(target["c"], torch.zeros(1))  # nothing loaded before the check


def test_restore_unknown_step_lists_available(root: str) -> None:
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(2, {"w": torch.ones(1)})
        mgr.save(3, {"w": torch.ones(1)})
        with pytest.raises(CheckpointNotFoundError, match=r"available steps: \[2, 3\]") as ei:
            mgr.restore(7, {"w": torch.zeros(1)})
        assert ei.value.available == [2, 3]
        with pytest.raises(CheckpointNotFoundError):
            mgr.step_info(7)
        with pytest.raises(LookupError):
            mgr.restore(8, {"w": torch.zeros(1)})


def test_uncommitted_step_is_not_listed(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=1) as mgr:
        mgr.save(1, {"w": torch.ones(1)})
    os.makedirs(os.path.join(local_root, "5"))
    with open(os.path.join(local_root, "5", "data-0123456789ab-r00000-000.bin"), "wb") as f:
        f.write(b"half")
    os.makedirs(os.path.join(local_root, ".tmp-6-0123456789ab"))
    with CheckpointManager(local_root, save_interval=1) as mgr:
        assert mgr.all_steps() == [1]
        with pytest.raises(IncompleteCheckpointError):
            mgr.restore(5, {"w": torch.zeros(1)})
        mgr.save(7, {"w": torch.ones(1)})
        # leftovers of crashed saves (only ckptmgr's file names) are removed after a commit
        assert sorted(n for n in os.listdir(local_root) if n != LEASE_NAME) == ["1", "7"]


def test_pickle_needs_trusted(root: str) -> None:
    class Thing:
        def __eq__(self, other: object) -> bool:
            return isinstance(other, Thing)

    with CheckpointManager(root, save_interval=1) as mgr:
        with pytest.raises(UnsafeCheckpointError, match="trusted=True"):
            mgr.save(1, {"obj": torch.device("cpu")})
        assert mgr.all_steps() == []
        mgr.save(1, {"obj": torch.device("cpu"), "w": torch.ones(1)}, trusted=True)
        out: dict[str, Any] = {"obj": None, "w": torch.zeros(1)}
        with pytest.raises(UnsafeCheckpointError, match="trusted=True"):
            mgr.restore(1, out)
        assert out["obj"] is None and torch.equal(out["w"], torch.zeros(1))
        mgr.restore(1, {"w": out["w"]})  # the tensor alone needs no trust
        mgr.restore(1, out, trusted=True)
        assert out["obj"] == torch.device("cpu")


def test_state_is_copied_python_values_by_value(local_root: str) -> None:
    extra = {"epoch": 1, "lst": [1, 2]}
    with CheckpointManager(local_root, save_interval=1) as mgr:
        mgr.save(1, {"extra": extra, "w": torch.ones(1)})
        extra["epoch"] = 99
        extra["lst"].append(3)
        mgr.restore(1, {"extra": extra, "w": torch.zeros(1)})
    assert extra == {"epoch": 1, "lst": [1, 2]}


def test_retention_max_to_keep(root: str) -> None:
    with CheckpointManager(root, save_interval=1, max_to_keep=2) as mgr:
        for s in range(5):
            mgr.save(s, {"w": torch.full((1,), float(s))})
        assert mgr.all_steps() == [3, 4]
    with CheckpointManager(root, save_interval=1, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [3, 4]
        mgr.save(10, {"w": torch.ones(1)})
        assert mgr.all_steps() == [4, 10]
    with CheckpointManager(root, save_interval=1, max_to_keep=0) as mgr:
        for s in (11, 12, 13):
            mgr.save(s, {"w": torch.ones(1)})
        assert mgr.all_steps() == [4, 10, 11, 12, 13]


def test_retention_orders_by_step_not_save_order(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=1, max_to_keep=2) as mgr:
        for s in (10, 30, 20):
            mgr.save(s, {"w": torch.ones(1)})
        assert mgr.all_steps() == [20, 30]
        mgr.save(5, {"w": torch.ones(1)})  # older than the newest: kept by the save itself
        assert mgr.all_steps() == [5, 20, 30]
        mgr.save(40, {"w": torch.ones(1)})  # the next save's retention counts by step number
        assert mgr.all_steps() == [30, 40]


def test_deep_copy_of_state_unaffected(local_root: str) -> None:
    state = all_dtypes_state(1)
    before = copy.deepcopy(state)
    with CheckpointManager(local_root, save_interval=1) as mgr:
        mgr.save(1, state)
    assert_same(before, state)


@pytest.mark.parametrize("bad", [0, -1, True, 1.0, "10", None])
def test_bad_interval(local_root: str, bad: Any) -> None:
    with pytest.raises(ConfigError, match="save_interval"):
        CheckpointManager(local_root, save_interval=bad)
    assert not os.path.exists(local_root)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", None])
def test_bad_step(local_root: str, bad: Any) -> None:
    with CheckpointManager(local_root, save_interval=1) as mgr:
        for call in (lambda: mgr.save(bad, {}), lambda: mgr.save_async(bad, {}),
                     lambda: mgr.should_save(bad), lambda: mgr.restore(bad, {}),
                     lambda: mgr.step_info(bad)):
            with pytest.raises(ConfigError, match="step"):
                call()


def test_bad_urls(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match="unknown URL scheme 'bogus'"):
        CheckpointManager("bogus://x/y", save_interval=1)
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match="existing file"):
        CheckpointManager(str(f), save_interval=1)
    with pytest.raises(ConfigError):
        CheckpointManager("", save_interval=1)


def test_missing_backend_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec

    real = fsspec.get_filesystem_class

    def missing(protocol: str) -> Any:
        # Fault injection: the backend packages may be installed here, so make them "absent".
        if protocol in ("gs", "gcs", "s3"):
            raise ImportError(f"Install the {protocol} backend (injected)")
        return real(protocol)

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    # The package is on no registry: the hint names the backend package, never ckptmgr.
    for url, package in (("gs://bucket/run", "gcsfs"), ("s3://bucket/run", "s3fs")):
        with pytest.raises(ckptmgr.BackendNotInstalledError,
                           match=rf"pip install {package} ") as ei:
            CheckpointManager(url, save_interval=1)
        assert isinstance(ei.value, ImportError)
        assert "ckptmgr[" not in str(ei.value) or "pip install -e" in str(ei.value)


def test_bad_metrics_and_state(local_root: str) -> None:
    with CheckpointManager(local_root, save_interval=1) as mgr:
        with pytest.raises(ConfigError, match="metrics"):
            mgr.save(1, {}, metrics={"loss": "low"})
        with pytest.raises(ConfigError, match="metadata"):
            mgr.save(1, {}, metadata={"x": object()})
        with pytest.raises(ConfigError, match="state_dict"):
            mgr.save(1, [torch.ones(1)])  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="flatten to key"):
            mgr.save(1, {"a": {"b": torch.ones(1)}, "a.b": torch.ones(1)})
        assert mgr.all_steps() == []


def test_closed_manager_refuses(local_root: str) -> None:
    mgr = CheckpointManager(local_root, save_interval=1)
    mgr.close()
    with pytest.raises(ckptmgr.CkptmgrError, match="closed"):
        mgr.save(1, {"w": torch.ones(1)})


_MINUS_O_SCRIPT = r"""
import sys, torch, ckptmgr
root = sys.argv[1]
with ckptmgr.CheckpointManager(root, save_interval=1) as m:
    m.save(1, {"w": torch.ones(3)})
    bads = ({"w": torch.ones(4)}, {"w": torch.ones(3, dtype=torch.int64)}, {"x": torch.ones(1)})
    for bad in bads:
        try:
            m.restore(1, bad)
        except ckptmgr.StateMismatchError:
            pass
        else:
            raise SystemExit("no StateMismatchError under -O")
    try:
        ckptmgr.CheckpointManager(root, save_interval=0)
    except ckptmgr.ConfigError:
        pass
    else:
        raise SystemExit("no ConfigError under -O")
print("OK")
"""


def _optimized_pycache(tmp_path: Path) -> str:
    """Where ``python -O`` may keep its ``.opt-1.pyc`` files between runs: beside the interpreter's
    install (ignored by git) when writable, else a fresh directory. Without one (this machine sets
    PYTHONDONTWRITEBYTECODE) every run compiles all of torch from source: ~25 s instead of ~4."""
    prefix = Path(sys.prefix) / ".pycache-opt"
    try:
        prefix.mkdir(mode=0o700, exist_ok=True)
        if prefix.stat().st_uid == os.getuid() and os.access(prefix, os.W_OK):
            return str(prefix)
    except OSError:
        pass
    return str(tmp_path)


def test_errors_under_python_O(local_root: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = _optimized_pycache(tmp_path)
    out = subprocess.run([sys.executable, "-O", "-c", _MINUS_O_SCRIPT, local_root],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout
