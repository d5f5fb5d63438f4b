"""Trust I, defects 8, 9, 10, 14 and 15 (issue 25): each test failed on main before its fix.

- 8: a reader racing retention is told the step was deleted while it was read
  (CheckpointNotFoundError), not "No such file" (StorageError) or "damaged" (verify exit 3);
- 9: restore/save of something that is not a dict is a ConfigError before any I/O;
- 10: every Python container shape round-trips exactly (empty dicts inside list values were
  dropped by DCP's flattening of sharded tensors);
- 14: one bad step does not break ``ls`` or ``verify --all``, and nothing read from storage reaches
  the terminal with its control characters;
- 15: a store gone for good fails the whole save within the retry budget (a deadline for the
  save's failures, its clean-up included), not once per call.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _faulty import Gate
from _servers import S3_ERROR_BODIES, Fault, FaultProxy, MotoS3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptmgr import (
    AsyncSaveError,
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    SaveError,
    cli,
)
from ckptmgr.storage import _retry
from ckptmgr.storage.local import LocalStorage

# ----------------------------------------------------------------- 8: readers racing retention


def _gate_data_reads(obj: Any, gate: Gate, names: tuple[str, ...]) -> None:
    """Hold every read of a data file through ``obj``'s methods ``names`` at ``gate``."""
    for name in names:
        method = getattr(obj, name)

        def held(path: str, *args: Any, _method: Any = method, **kwargs: Any) -> Any:
            if "/data-" in path:
                gate.pass_()
            return _method(path, *args, **kwargs)

        setattr(obj, name, held)


def _in_thread(fn: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # handed to the test
            errors.append(e)

    t = threading.Thread(target=run, name="reader")
    t.start()
    return t, errors


def test_reader_racing_retention_is_told_the_step_was_deleted(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1, max_to_keep=1) as writer:
        writer.save(1, {"w": torch.ones(1000), "v": 1})
        reader = CheckpointManager(root, save_interval=1, read_only=True)
        gate = Gate()
        # The reader has read step 1's manifest and metadata; its data reads wait here.
        _gate_data_reads(reader._store.storage, gate, ("open_reader", "read_into", "read_bytes"))
        t, errors = _in_thread(lambda: reader.restore(1, {"w": torch.zeros(1000), "v": 0}))
        gate.wait_arrived()
        writer.save(2, {"w": torch.full((1000,), 2.0), "v": 2})  # retention deletes step 1
        assert writer.all_steps() == [2]
        gate.open()
        t.join(60)
        reader.close()
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], CheckpointNotFoundError), errors
    text = str(errors[0])
    assert "step 1 was deleted" in text and "while it was being read" in text, text
    assert "available steps: [2]" in text, text
    assert errors[0].available == [2]


def test_cli_verify_racing_retention_says_deleted_not_corrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1, max_to_keep=1) as writer:
        writer.save(1, {"w": torch.ones(1000)})
        gate = Gate()
        # The CLI's reads of data files wait here (the writer's thread passes).
        read_into = LocalStorage.read_into

        def held(self: LocalStorage, path: str, *args: Any) -> None:
            if "/data-" in path and threading.current_thread().name == "reader":
                gate.pass_()
            read_into(self, path, *args)

        monkeypatch.setattr(LocalStorage, "read_into", held)
        code: list[int] = []
        t, errors = _in_thread(lambda: code.append(cli.main(["verify", root, "1"])))
        gate.wait_arrived()
        writer.save(2, {"w": torch.full((1000,), 2.0)})  # retention deletes step 1
        gate.open()
        t.join(60)
    monkeypatch.undo()
    assert not errors and code == [cli.EXIT_ERROR], (errors, code)  # not 3: nothing is damaged
    out, err = capsys.readouterr()
    assert "CORRUPT" not in out and "step 1 was deleted" in err, (out, err)


def test_cli_inspect_racing_retention_says_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1, max_to_keep=1) as writer:
        writer.save(1, {"w": torch.ones(10)})
        gate = Gate()
        read_bytes = LocalStorage.read_bytes

        def held(self: LocalStorage, path: str, *args: Any) -> bytes:
            # inspect has read the manifest; its read of the metadata file waits here
            if "/metadata-" in path and threading.current_thread().name == "reader":
                gate.pass_()
            return read_bytes(self, path, *args)

        monkeypatch.setattr(LocalStorage, "read_bytes", held)
        code: list[int] = []
        t, errors = _in_thread(lambda: code.append(cli.main(["inspect", root, "1"])))
        gate.wait_arrived()
        writer.save(2, {"w": torch.full((10,), 2.0)})  # retention deletes step 1
        gate.open()
        t.join(60)
    monkeypatch.undo()
    _, err = capsys.readouterr()
    assert not errors and code == [cli.EXIT_ERROR], (errors, code, err)
    assert "step 1 was deleted" in err and "available steps: [2]" in err, err


# ---------------------------------------------------------------- 9: a state that is no dict


@pytest.mark.parametrize("bad", [[1, 2], None, torch.zeros(3), "model"],
                         ids=["list", "None", "tensor", "str"])
def test_state_dict_that_is_not_a_dict_is_a_config_error_before_any_io(
        tmp_path: Path, bad: Any) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        calls: list[str] = []
        storage = mgr._store.storage
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


# ------------------------------------------------------- 10: Python values round-trip exactly


def _same(a: Any, b: Any) -> bool:
    """Equal, with the same types all the way down (1 is not 1.0, a tuple is not a list)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return bool(a == b)


def _blank(value: Any) -> Any:
    """A restore target of the same structure as ``value`` (what the state flattens the same
    way: dicts are walked, lists and tuples only when they hold a tensor), leaves wiped."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_blank(v) for v in value)
    return None


def test_empty_dict_inside_a_list_value_round_trips(tmp_path: Path) -> None:
    # Lightning's checkpoint of a plain-SGD optimizer: its state is an empty dict.
    opt = [{"state": {}, "param_groups": [{"lr": 0.1, "momentum": 0, "params": [0, 1]}]}]
    state = {"w": torch.ones(2), "optimizer_states": opt,
             "deep": [{0: {"a": {}}, "x": [{}], "y": ({},), "z": ()}],
             "mixed": [torch.ones(1), {}, [], (), [{}]]}
    with CheckpointManager(str(tmp_path / "run"), save_interval=1) as mgr:
        mgr.save(1, state)
        out = _blank(state)
        mgr.restore(1, out)
    assert _same(out, state), out
    assert out["optimizer_states"][0]["state"] == {}


_KEYS = st.text(alphabet="abcxyz_", min_size=1, max_size=4)
# Empty containers are leaves as likely as scalars: they are what DCP's flattening dropped.
_SCALARS: Any = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
            | st.floats(allow_nan=False) | st.text(max_size=5)
            | st.builds(dict) | st.builds(list) | st.builds(tuple))


def _containers(children: Any) -> Any:
    return (st.lists(children, max_size=3) | st.tuples() | st.tuples(children)
            | st.tuples(children, children) | st.dictionaries(_KEYS, children, max_size=3)
            | st.dictionaries(st.integers(0, 5), children, max_size=2))


_VALUES = st.recursive(_SCALARS, _containers, max_leaves=12)


@pytest.fixture(scope="module")
def shared_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("roundtrip") / "run")


@pytest.mark.parametrize("mode", ["save", "save_async"])
@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_VALUES, nested=_VALUES)
def test_python_values_round_trip_exactly(shared_root: str, mode: str, value: Any,
                                          nested: Any) -> None:
    # Python values at the top, inside a walked dict, and beside a tensor in a walked list.
    state = {"v": value, "d": {"inner": nested, "e": {}}, "t": [torch.arange(3.0), nested]}
    with CheckpointManager(shared_root, save_interval=1, max_to_keep=1,
                           async_mode="thread") as mgr:
        step = (mgr.latest_step() or 0) + 1
        getattr(mgr, mode)(step, state)
        mgr.join()
        out = _blank(state)
        mgr.restore(step, out)
    assert _same(out, state), (out, state)


# ------------------------------------------------------------- 14: one bad step, the terminal


@pytest.fixture
def root_with_a_bad_step(tmp_path: Path) -> str:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, {"w": torch.full((2,), float(s))},
                     metrics={"loss\x1b[31m\x1b]0;pwned\x07": 0.5},
                     metadata={"note\x1b[2J": "x\rgone\u202e"})
    path = os.path.join(root, "2", "commit.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["files"][0]["path"] = "../../etc/passwd"
    with open(path, "w") as f:
        json.dump(manifest, f)
    return root


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_lists_every_other_step_and_marks_the_bad_one(
        root_with_a_bad_step: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "ls", root_with_a_bad_step)
    assert code == cli.EXIT_OK, err
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert set(rows) == {"1", "2", "3"}, out
    assert "committed" in rows["1"] and "committed" in rows["3"]
    assert "unreadable" in rows["2"] and "escapes the step directory" in rows["2"]
    code, out, err = _run(capsys, "ls", root_with_a_bad_step, "--json")
    assert code == cli.EXIT_OK
    assert [(e["step"], e["status"]) for e in json.loads(out)] == [
        (1, "committed"), (2, "unreadable"), (3, "committed")]


def test_verify_all_reports_the_bad_step_as_damage(
        root_with_a_bad_step: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "verify", root_with_a_bad_step, "--all")
    assert code == cli.EXIT_CORRUPT, (out, err)  # documented: 3 on damage
    assert "step 1: ok" in out and "step 3: ok" in out and "step 2: CORRUPT" in out
    assert "2/commit.json" in err


def test_strings_from_storage_reach_the_terminal_escaped(
        root_with_a_bad_step: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["inspect", root_with_a_bad_step, "3"], ["ls", root_with_a_bad_step],
                 ["verify", root_with_a_bad_step, "--all"],
                 ["inspect", root_with_a_bad_step, "2"]):
        _, out, err = _run(capsys, *argv)
        for text in (out, err):
            controls = [c for c in text if (ord(c) < 32 and c != "\n") or 0x7f <= ord(c) < 0xa0
                        or c == "\u202e"]
            assert not controls, (argv, controls, text)
    _, out, _ = _run(capsys, "inspect", root_with_a_bad_step, "3")
    assert "loss\\x1b[31m\\x1b]0;pwned\\x07=0.5" in out, out
    assert cli.printable("a\x1bb\nc\u202ed\x9b") == "a\\x1bb\\nc\\u202ed\\x9b"
    assert cli.printable("plain text, ünïcode") == "plain text, ünïcode"


def test_a_manifest_naming_an_escaping_path_in_a_metadata_file_is_damage_too(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_interval=1) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    path = os.path.join(root, "1", "commit.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["metadata_file"] = "../../../etc/passwd"
    with open(path, "w") as f:
        json.dump(manifest, f)
    code, out, err = _run(capsys, "verify", root, "--all")
    assert code == cli.EXIT_CORRUPT, (out, err)
    code, out, err = _run(capsys, "ls", root)
    assert code == cli.EXIT_OK and "unreadable" in out, (out, err)


# ---------------------------------------------------------------- 15: the retry budget


class _VirtualTime:
    """``time`` for the retry module: backoff sleeps advance a virtual clock instead of
    waiting; the clock is the real one plus every sleep so far (so the budget is checked on
    behaviour: how much retrying the code allowed itself, not how fast this machine is)."""

    def __init__(self) -> None:
        self._slept = 0.0
        self._lock = threading.Lock()
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        with self._lock:
            return time.monotonic() + self._slept

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self._slept += seconds
            self.sleeps.append(seconds)
        time.sleep(0.001)  # let other threads run


@pytest.fixture
def s3_proxy(moto_s3: MotoS3) -> Iterator[FaultProxy]:
    proxy = FaultProxy(moto_s3.endpoint_url)
    yield proxy
    proxy.stop()


BUDGET_S = 4.0


@pytest.mark.parametrize("how", ["503", "reset"])
def test_a_store_gone_mid_save_fails_it_within_the_budget(
        moto_s3: MotoS3, s3_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch,
        how: str) -> None:
    import s3fs

    # The budget is the knob (DEFAULT_POLICY.total_timeout_s); many attempts allowed per call,
    # so only the budget can stop the loops. The clients' own retries are off.
    monkeypatch.setattr(_retry, "DEFAULT_POLICY", _retry.RetryPolicy(
        max_attempts=10**6, initial_backoff_s=0.05, max_backoff_s=0.2, total_timeout_s=BUDGET_S))
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    clock = _VirtualTime()
    monkeypatch.setattr(_retry, "time", clock)
    opts = moto_s3.storage_options(endpoint_url=s3_proxy.url,
                                   config_kwargs={"retries": {"max_attempts": 0}})
    gone: list[float] = []  # when the store went away (virtual clock)

    def store_gone(method: str, path: str) -> bool:
        # From the first data write of step 2 on, every request fails: the store is gone.
        if not gone and method in ("PUT", "POST") and "/2/data-" in path:
            gone.append(clock.monotonic())
        return bool(gone)

    url = f"s3://ckpt-tests/{uuid.uuid4().hex}"
    state = {"w": torch.arange(3 * 2**20, dtype=torch.float32)}
    t0 = time.monotonic()
    with CheckpointManager(url, save_interval=1, storage_options=opts,
                           async_mode="thread") as mgr:
        mgr.save(1, state)
        # Every request answered with 503, or its connection reset (a server going down).
        fault = s3_proxy.add(Fault(store_gone, times=10**9, reset=how == "reset",
                                   status=503 if how == "503" else None,
                                   body=S3_ERROR_BODIES[503]))
        mgr.save_async(2, state)
        with pytest.raises(AsyncSaveError) as ei:
            mgr.join()
        failed_at = clock.monotonic()
        fault.times = 0  # the store is back: close() releases the lease
        assert isinstance(ei.value, SaveError)
        assert gone and fault.hits > 2
        # The whole save failed within the budget from the moment the store went away: its
        # writes, its commit and the clean-up of the failed attempt drew from one deadline.
        # (Slack: the requests in flight when it ran out, answered at once by the proxy.)
        assert failed_at - gone[0] <= BUDGET_S + 1.5, (failed_at - gone[0], clock.sleeps)
        assert mgr.all_steps() == [1]
    assert time.monotonic() - t0 < 3 * 60  # a hang guard only


def test_the_budget_is_a_deadline_started_by_the_first_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _VirtualTime()
    monkeypatch.setattr(_retry, "time", clock)
    policy = _retry.RetryPolicy(max_attempts=10**6, initial_backoff_s=0.5, max_backoff_s=1.0,
                                total_timeout_s=10**6)
    calls: list[str] = []

    def ok() -> str:
        calls.append("ok")
        return "ok"

    def down() -> None:
        calls.append("down")
        raise ConnectionResetError("reset")

    with _retry.retry_budget(5.0) as budget:
        clock.sleep(100.0)  # a long healthy save spends nothing of its budget
        assert _retry.call_with_retries(ok, what="put a", policy=policy) == "ok"
        assert budget.deadline is None
        start = clock.monotonic()
        with pytest.raises(ConnectionResetError):
            _retry.call_with_retries(down, what="put b", policy=policy)
        assert budget.deadline is not None and budget.deadline <= start + 5.0 + 0.5
        assert clock.monotonic() - start <= 5.0 + 0.5  # stopped by the deadline, not the count
        tries = calls.count("down")
        assert tries > 3
        # Past the deadline, while the store still fails: no new request at all.
        clock.sleep(max(0.0, budget.deadline - clock.monotonic()))
        with pytest.raises(_retry.RetryBudgetSpent) as ei:
            _retry.call_with_retries(down, what="delete c", policy=policy)
        assert calls.count("down") == tries and isinstance(ei.value.__cause__,
                                                          ConnectionResetError)
    with _retry.retry_budget(5.0) as budget:
        with pytest.raises(ConnectionResetError):
            _retry.call_with_retries(down, what="put d", policy=_retry.RetryPolicy(
                max_attempts=2, initial_backoff_s=0.5, max_backoff_s=1.0, total_timeout_s=60))
        assert budget.deadline is not None
        assert _retry.call_with_retries(ok, what="put e", policy=policy) == "ok"
        assert budget.deadline is None  # the outage is over: the next one gets a new deadline


def test_one_slow_time_out_still_gets_a_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first attempt that timed out after 50 s of a 90 s budget is retried (it succeeds): a
    retry is reckoned to take at most a quarter of the budget, not the slow attempt's time."""
    clock = _VirtualTime()
    monkeypatch.setattr(_retry, "time", clock)
    answers = iter([TimeoutError("read timed out"), "ok"])

    def slow_then_ok() -> str:
        answer = next(answers)
        if isinstance(answer, BaseException):
            clock.sleep(50.0)
            raise answer
        return answer

    policy = _retry.RetryPolicy(max_attempts=5, initial_backoff_s=0.5, max_backoff_s=1.0,
                                total_timeout_s=90.0)
    with _retry.retry_budget(90.0) as budget:
        assert _retry.call_with_retries(slow_then_ok, what="get a", policy=policy) == "ok"
        assert budget.deadline is None and budget.remaining_s == 90.0


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")
@pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*")
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")
def test_lightning_resumes_a_plain_sgd_model(tmp_path: Path) -> None:
    # Plain SGD keeps no per-parameter state: Lightning saves {"state": {}, ...} in a list.
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from ckptmgr.integrations.lightning import CkptmgrCheckpointIO

    class Sgd(lightning.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(8, 4, generator=g),
                                    torch.randn(8, 2, generator=g)), batch_size=4)

    def fit(max_steps: int, resume: bool) -> Any:
        trainer = lightning.Trainer(
            max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
            enable_model_summary=False, plugins=[CkptmgrCheckpointIO()],
            callbacks=[ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2,
                                       save_last=True, save_top_k=-1)])
        trainer.fit(Sgd(), data, ckpt_path="last" if resume else None)
        return trainer

    fit(3, resume=False)
    trainer = fit(6, resume=True)  # was KeyError: 'state' in the optimizer's load_state_dict
    assert trainer.global_step == 6
    assert trainer.optimizers[0].state_dict()["state"] == {}
