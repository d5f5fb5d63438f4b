"""ckptmgr's DCP storage layer on its own: ``CkptStorageWriter(url)`` / ``CkptStorageReader(url)``
under plain ``torch.distributed.checkpoint.save`` / ``load`` with DCP's own planners, and the SPMD
planners under plain DCP.

The behaviours PyTorch's own storage tests check for ``FileSystemWriter``/``FileSystemReader`` and
``FsspecWriter``/``FsspecReader`` (test/distributed/checkpoint: ``test_file_system_checkpoint_cpu``,
``test_fsspec``, ``test_checkpoint``, ``test_save_load_api``), with ours in their place, in tests of
our own: tensors only; tensors next to Python values and blobs; a model's state dict; loading with
and without resharding (one shard plan saved, another loaded, across world sizes, sharded into
plain and back); repeated saves into one directory; DCP's ``checkpoint_id``; a rank failing in any
step. Then what ours adds: values as JSON (pickle refused unless trusted), checksums, the commit
protocol, and the directories it shares with the manager.

Single-process cases run in this process; multi-process ones on real gloo groups (tests/_procs.py).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _procs import run_ranks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from ckptmgr import CheckpointManager
from ckptmgr.dcp import (
    CkptStorageReader,
    CkptStorageWriter,
    SpmdLoadPlanner,
    SpmdSavePlanner,
)
from ckptmgr.dcp.shards import CpuShardedTensor
from ckptmgr.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)

# DCP warns on every call without a process group that it assumes one process: our intent here.
pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is (disabled, )?unavailable or uninitialized:UserWarning")


class Net(torch.nn.Module):
    """A small model with an embedding bag, as PyTorch's storage tests use."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = torch.nn.Linear(5, 5)
        self.linear_2 = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)


class Blob:
    """A Stateful whose state is a blob (DCP's own tests keep ``bytes`` in one)."""

    def __init__(self, value: Any) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


class Opaque:
    """An object only pickle can store."""

    def __init__(self, x: int) -> None:
        self.x = x


def _failure(e: BaseException) -> BaseException:
    """The lowest rank's error inside DCP's CheckpointException."""
    assert isinstance(e, CheckpointException), e
    rank = min(e.failures)
    f = e.failures[rank]
    return f[0] if isinstance(f, tuple) else f


def _save(sd: dict[str, Any], url: str, **kw: Any) -> None:
    dcp.save(sd, storage_writer=CkptStorageWriter(url, **kw))


def _load(sd: dict[str, Any], url: str, **kw: Any) -> None:
    dcp.load(sd, storage_reader=CkptStorageReader(url, **kw))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _data_files(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("data-"))


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    """An existing empty directory, as ``tempfile.mkdtemp`` gives DCP's own tests."""
    return tmp_path


# ---------------------------------------------------------------------- tensors, one process


def test_tensors_round_trip_without_resharding(ckpt: Path) -> None:
    saved = Net().state_dict()
    _save(saved, str(ckpt))
    target = Net().state_dict()
    assert not _same(target, saved)
    _load(target, str(ckpt))
    assert _same(target, saved)
    assert sorted(os.listdir(ckpt))[0] == "commit.json"


def test_a_models_state_nested_as_in_the_fsspec_tests(ckpt: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.rand(8, 8)).sum().backward()
    optim.step()
    _save({"model": model.state_dict(), "optim": optim.state_dict()}, str(ckpt))
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    model2(torch.rand(8, 8)).sum().backward()
    optim2.step()  # creates the state to load into
    state = {"model": model2.state_dict(), "optim": optim2.state_dict()}
    dcp.load(state, storage_reader=CkptStorageReader(str(ckpt)), planner=DefaultLoadPlanner())
    model2.load_state_dict(state["model"])
    optim2.load_state_dict(state["optim"])
    for p1, p2 in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p1, p2)
    for s1, s2 in zip(optim.state.values(), optim2.state.values(), strict=True):
        assert torch.equal(s1["exp_avg"], s2["exp_avg"])
        assert torch.equal(s1["exp_avg_sq"], s2["exp_avg_sq"])
    assert optim2.param_groups[0]["lr"] == 0.1


def test_dtype_of_the_target_wins_as_in_dcp(ckpt: Path) -> None:
    w = torch.rand(4, 3)
    _save({"w": w}, str(ckpt))
    target = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
    _load(target, str(ckpt))
    assert target["w"].dtype == torch.bfloat16 and torch.equal(target["w"], w.bfloat16())


def test_sharded_chunks_and_slices_of_one_tensor(ckpt: Path) -> None:
    # A non-contiguous source and a target that is a view: both go through buffers.
    big = torch.arange(60.0).reshape(6, 10)
    _save({"t": big.t(), "v": torch.arange(5.0)}, str(ckpt))
    holder = torch.zeros(10, 12)
    target = {"t": holder[:, 3:9], "v": torch.zeros(5)}
    _load(target, str(ckpt))
    assert torch.equal(holder[:, 3:9], big.t()) and holder[:, :3].sum() == 0


# ------------------------------------------------------------------ Python values and blobs


def test_python_values_load_under_dcps_default_planner(ckpt: Path) -> None:
    # DCP flattens dicts (OrderedDicts too) into keys; a tuple is one value, whatever it holds.
    odict = OrderedDict(b=1, a=2)
    saved = {"bytes0": [1], "bytes1": "string", "t": torch.ones(2),
             "extra": {"epoch": 3, "best": float("nan"), "pair": (1, 2.5), "none": None,
                       "kept": (odict, {3: "x", 4: "y"}, [None]), "flag": True}}
    _save(saved, str(ckpt))
    target = {"bytes0": [2], "bytes1": "other", "t": torch.zeros(2),
              "extra": {"epoch": 0, "best": 0.0, "pair": None, "none": 1, "kept": None,
                        "flag": False}}
    _load(target, str(ckpt))
    assert target["bytes0"] == [1] and target["bytes1"] == "string"
    extra = target["extra"]
    assert extra["epoch"] == 3 and math.isnan(extra["best"]) and extra["pair"] == (1, 2.5)
    assert extra["none"] is None and extra["flag"] is True
    od, ids, rest = extra["kept"]
    assert type(od) is OrderedDict and list(od.items()) == [("b", 1), ("a", 2)]
    assert ids == {3: "x", 4: "y"} and rest == [None]
    # stored as JSON: no pickle in the step
    md = CkptStorageReader(str(ckpt)).read_metadata()
    assert {loc.enc for loc in md.storage_data.values()} == {"raw", "json"}


def test_values_land_where_the_load_planner_flattened_them(ckpt: Path) -> None:
    _save({"a": {"b": {"c": 5}, "l": [1, {"x": torch.arange(3.0)}]}}, str(ckpt))
    md = CkptStorageReader(str(ckpt)).read_metadata()
    assert md.planner_data == {"a.b.c": ("a", "b", "c"), "a.l.0": ("a", "l", 0),
                               "a.l.1.x": ("a", "l", 1, "x")}
    target = {"a": {"b": {"c": 0}, "l": [0, {"x": torch.zeros(3)}]}}
    _load(target, str(ckpt))
    assert target["a"]["b"]["c"] == 5 and target["a"]["l"][0] == 1
    assert torch.equal(target["a"]["l"][1]["x"], torch.arange(3.0))


@pytest.mark.parametrize("blob", [b"SomeBlobForTesting", io.BytesIO(b"SomeBlobForTesting"),
                                  Opaque(3)], ids=["bytes", "BytesIO", "object"])
def test_values_that_need_pickle_are_refused_unless_trusted(ckpt: Path, blob: Any) -> None:
    state = {"model": Net().state_dict(), "test_blob": Blob(blob)}
    with pytest.raises(CheckpointException) as info:
        _save(state, str(ckpt))
    err = _failure(info.value)
    assert isinstance(err, UnsafeCheckpointError) and "trusted=True" in str(err)
    assert os.listdir(ckpt) == []  # refused before any byte was written

    _save(state, str(ckpt), trusted=True)
    target = {"model": Net().state_dict(), "test_blob": Blob(None)}
    with pytest.raises(CheckpointException) as info:
        _load(target, str(ckpt))  # the reader needs trusted=True too
    assert isinstance(_failure(info.value), UnsafeCheckpointError)
    _load(target, str(ckpt), trusted=True)
    got = target["test_blob"].state["blob"]
    if isinstance(blob, io.BytesIO):
        assert got.getvalue() == blob.getvalue()
    elif isinstance(blob, Opaque):
        assert isinstance(got, Opaque) and got.x == 3
    else:
        assert got == blob
    assert _same(target["model"], state["model"])


def test_a_planner_without_lookup_object_gives_values_only_as_pickle(ckpt: Path) -> None:
    class PickleOnly(DefaultSavePlanner):
        def __getattribute__(self, name: str) -> Any:
            if name == "lookup_object":
                raise AttributeError(name)
            return super().__getattribute__(name)

        def resolve_data(self, write_item: Any) -> Any:
            obj = DefaultSavePlanner.lookup_object(self, write_item.index)
            return self.transform_object(write_item, obj)

    with pytest.raises(CheckpointException) as info:
        dcp.save({"v": 1}, storage_writer=CkptStorageWriter(str(ckpt)), planner=PickleOnly())
    assert "lookup_object" in str(_failure(info.value))
    dcp.save({"v": 1}, storage_writer=CkptStorageWriter(str(ckpt), trusted=True),
             planner=PickleOnly())
    target = {"v": 0}
    _load(target, str(ckpt), trusted=True)
    assert target["v"] == 1


# -------------------------------------------------------------------- checkpoint_id, reset


def test_checkpoint_id_sets_the_url(tmp_path: Path) -> None:
    writer, reader = CkptStorageWriter(), CkptStorageReader()
    for i, name in enumerate(["a", "b"]):
        dcp.save({"x": torch.full((3,), float(i))}, checkpoint_id=str(tmp_path / name),
                 storage_writer=writer)
    for i, name in enumerate(["a", "b"]):
        target = {"x": torch.zeros(3)}
        dcp.load(target, checkpoint_id=tmp_path / name, storage_reader=reader)
        assert torch.equal(target["x"], torch.full((3,), float(i)))
    assert writer.url == str(tmp_path / "b") and reader.url == str(tmp_path / "b")
    # reset() without an id (what DCP's deprecated entry points call) keeps the URL
    writer.reset()
    dcp.save({"x": torch.full((3,), 9.0)}, storage_writer=writer)
    target = {"x": torch.zeros(3)}
    dcp.load(target, storage_reader=reader)  # read again: not the metadata of the last load
    assert torch.equal(target["x"], torch.full((3,), 9.0))


def test_no_url_at_all_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException) as info:
        dcp.save({"x": torch.zeros(1)}, storage_writer=CkptStorageWriter())
    assert isinstance(_failure(info.value), ConfigError)
    with pytest.raises(CheckpointException) as info:
        dcp.load({"x": torch.zeros(1)}, storage_reader=CkptStorageReader())
    assert "no URL" in str(info.value)


def test_validate_checkpoint_id_and_arguments(tmp_path: Path) -> None:
    for ok in [str(tmp_path), tmp_path, "memory://x/y", "s3://bucket/run/7", "file:///tmp/x"]:
        assert CkptStorageWriter.validate_checkpoint_id(ok)
        assert CkptStorageReader.validate_checkpoint_id(ok)
    for bad in ["", "nosuchscheme://x", None, 7]:
        assert not CkptStorageWriter.validate_checkpoint_id(bad)  # type: ignore[arg-type]
        assert not CkptStorageReader.validate_checkpoint_id(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="trusted"):
        CkptStorageWriter(str(tmp_path), trusted="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown URL scheme"):
        CkptStorageReader("nosuchscheme://x")
    with pytest.raises(ConfigError, match="storage_options"):
        CkptStorageWriter(str(tmp_path), storage_options=["anon"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="checkpoint_id"):
        CkptStorageWriter().reset(3)  # type: ignore[arg-type]
    assert repr(CkptStorageReader(tmp_path)) == f"CkptStorageReader({str(tmp_path)!r})"


def test_writer_and_reader_pickle_for_dcps_process_async_save(ckpt: Path) -> None:
    writer = pickle.loads(pickle.dumps(CkptStorageWriter(str(ckpt))))
    dcp.save({"x": torch.ones(2)}, storage_writer=writer)
    reader = pickle.loads(pickle.dumps(CkptStorageReader(str(ckpt))))
    target = {"x": torch.zeros(2)}
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["x"], torch.ones(2))


def test_async_save_with_our_writer(ckpt: Path) -> None:
    state = {"x": torch.arange(4.0), "epoch": 2}
    fut = dcp.async_save(state, storage_writer=CkptStorageWriter(str(ckpt)))
    result = fut.result() if hasattr(fut, "result") else fut.upload_completion.result()
    del result
    target = {"x": torch.zeros(4), "epoch": 0}
    _load(target, str(ckpt))
    assert torch.equal(target["x"], torch.arange(4.0)) and target["epoch"] == 2


# ------------------------------------------------------------------ overwrite and directories


def test_saving_again_replaces_the_checkpoint_atomically(ckpt: Path) -> None:
    (ckpt / "notes.txt").write_text("mine")
    (ckpt / "data-train.csv").write_text("mine too")
    _save({"random": torch.ones(10)}, str(ckpt))
    first = _data_files(ckpt)
    _save({"random": torch.full((10,), 2.0)}, str(ckpt))
    target = {"random": torch.zeros(10)}
    _load(target, str(ckpt))
    assert torch.equal(target["random"], torch.full((10,), 2.0))
    now = _data_files(ckpt)
    assert len(now) == 2 and now != first and "data-train.csv" in now  # the old attempt is gone
    assert (ckpt / "notes.txt").read_text() == "mine"


def test_a_plain_dcp_checkpoint_is_never_written_into(ckpt: Path) -> None:
    dcp.save({"x": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(ckpt)))
    before = sorted(os.listdir(ckpt))
    with pytest.raises(CheckpointException) as info:
        _save({"x": torch.zeros(2)}, str(ckpt))
    assert isinstance(_failure(info.value), CheckpointExistsError)
    assert sorted(os.listdir(ckpt)) == before
    with pytest.raises(CheckpointException) as info:
        _load({"x": torch.zeros(2)}, str(ckpt))
    assert "plain-DCP checkpoint" in str(info.value) and "FileSystemReader" in str(info.value)


def test_reading_where_nothing_was_committed(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        CkptStorageReader(str(tmp_path / "nothing")).read_metadata()


def test_shares_directories_with_the_manager(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with CheckpointManager(str(root), save_interval=10) as mgr:
        mgr.save(10, {"w": torch.arange(6.0), "extra": {"epoch": 1}})
    # a manager's committed step reads as a checkpoint directory
    target = {"w": torch.zeros(6), "extra": {"epoch": 0}}
    _load(target, str(root / "10"))
    assert torch.equal(target["w"], torch.arange(6.0)) and target["extra"]["epoch"] == 1
    # a directory named like a step, written standalone, is a step the manager restores
    _save({"w": torch.arange(6.0) * 2, "extra": {"epoch": 2}}, str(root / "20"))
    with CheckpointManager(str(root), save_interval=10) as mgr:
        assert mgr.all_steps() == [10, 20]
        state = {"w": torch.zeros(6), "extra": {"epoch": 0}}
        mgr.restore(20, state)
    assert torch.equal(state["w"], torch.arange(6.0) * 2) and state["extra"]["epoch"] == 2
    with pytest.raises(CheckpointNotFoundError, match="ckptmgr root holding steps"):
        CkptStorageReader(str(root)).read_metadata()


def test_every_backend(root: str) -> None:
    url = f"{root}/ckpt"
    saved = {"model": Net().state_dict(), "extra": {"epoch": 4, "name": "run"}}
    _save(saved, url)
    _save(saved, url)  # overwrite on every backend
    target = {"model": Net().state_dict(), "extra": {"epoch": 0, "name": ""}}
    _load(target, url)
    assert _same(target["model"], saved["model"]) and target["extra"] == saved["extra"]


# ------------------------------------------------------------------ checksums and the commit


def _flip_byte(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_found_on_read(ckpt: Path) -> None:
    _save({"w": torch.arange(100.0), "v": {"epoch": 7}}, str(ckpt))
    (data,) = _data_files(ckpt)
    _flip_byte(ckpt / data, 40)
    with pytest.raises(CheckpointException) as info:
        _load({"w": torch.zeros(100)}, str(ckpt))
    err = _failure(info.value)
    assert isinstance(err, CorruptCheckpointError) and "checksum mismatch" in str(err)
    _flip_byte(ckpt / data, 40)
    (md,) = [n for n in os.listdir(ckpt) if n.startswith("metadata-")]
    _flip_byte(ckpt / md, 5)
    with pytest.raises(CorruptCheckpointError):
        CkptStorageReader(str(ckpt)).read_metadata()


def test_a_truncated_data_file_is_found_before_reading(ckpt: Path) -> None:
    _save({"w": torch.arange(100.0)}, str(ckpt))
    (data,) = _data_files(ckpt)
    with open(ckpt / data, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointException) as info:
        _load({"w": torch.zeros(100)}, str(ckpt))
    assert "truncated" in str(_failure(info.value))


def test_data_then_metadata_then_manifest(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptmgr.storage import LocalStorage

    order: list[str] = []
    real_open, real_write = LocalStorage.open_writer, LocalStorage.write_bytes

    def open_writer(self: LocalStorage, path: str, size_hint: int | None = None) -> Any:
        order.append(path)
        return real_open(self, path, size_hint)

    def write_bytes(self: LocalStorage, path: str, data: bytes, *, exclusive: bool = False
                    ) -> None:
        order.append(path)
        real_write(self, path, data, exclusive=exclusive)

    monkeypatch.setattr(LocalStorage, "open_writer", open_writer)
    monkeypatch.setattr(LocalStorage, "write_bytes", write_bytes)
    _save({"w": torch.ones(3), "v": 1}, str(ckpt))
    assert [p.split("-")[0] for p in order] == ["data", "metadata", "commit.json"]


def test_a_failed_save_commits_nothing_and_keeps_the_last_one(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptmgr.step_store import StepStore

    _save({"w": torch.ones(4)}, str(ckpt))
    kept = sorted(os.listdir(ckpt))

    class Failing(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            raise RuntimeError("disk on fire")

    with pytest.raises(CheckpointException, match="disk on fire"):
        dcp.save({"w": torch.zeros(4)}, storage_writer=CkptStorageWriter(str(ckpt)),
                 planner=Failing())

    def no_commit(*args: Any, **kwargs: Any) -> None:
        raise OSError("lost the manifest")

    monkeypatch.setattr(StepStore, "commit", no_commit)
    with pytest.raises(CheckpointException, match="lost the manifest"):
        _save({"w": torch.zeros(4)}, str(ckpt))
    monkeypatch.undo()
    # the failed commit removed its own files; the aborted write left no committed trace
    assert (ckpt / "commit.json").exists() and set(kept) <= set(os.listdir(ckpt))
    target = {"w": torch.zeros(4)}
    _load(target, str(ckpt))
    assert torch.equal(target["w"], torch.ones(4))
    _save({"w": torch.full((4,), 3.0)}, str(ckpt))  # the next save sweeps leftovers away
    assert len(_data_files(ckpt)) == 1


# --------------------------------------------------------------------- SPMD planners, one process


@pytest.mark.parametrize("storage", ["ckptmgr", "dcp-filesystem"])
def test_spmd_planners_with_plain_dcp(tmp_path: Path, storage: str) -> None:
    """torch_xla's usage, import changed: dcp.save(..., planner=SpmdSavePlanner()) with a nested
    state, then dcp.load(..., planner=SpmdLoadPlanner()) onto another mesh."""
    w = torch.arange(30.0).reshape(5, 6)
    path = str(tmp_path)

    def writer() -> Any:
        return CkptStorageWriter(path) if storage == "ckptmgr" else dcp.FileSystemWriter(path)

    def reader() -> Any:
        return CkptStorageReader(path) if storage == "ckptmgr" else dcp.FileSystemReader(path)

    state = {"model": {"w": CpuShardedTensor(w, (2, 2), (0, None)),  # partially replicated
                       "u": CpuShardedTensor(w[:3], (2, 2), (0, 1)),  # uneven, padded
                       "b": torch.ones(3)},
             "extra": {"epoch": 5, "lr": [0.1]}}
    dcp.save(state_dict=state, storage_writer=writer(), planner=SpmdSavePlanner())
    target = {"model": {"w": CpuShardedTensor(torch.zeros(5, 6), (4,), (None, 0)),
                        "u": CpuShardedTensor(torch.zeros(3, 6), (1, 4), (None, 1)),
                        "b": torch.zeros(3)},
              "extra": {"epoch": 0, "lr": [0.0]}}
    dcp.load(state_dict=target, storage_reader=reader(), planner=SpmdLoadPlanner())
    assert torch.equal(target["model"]["w"].to_full(), w)
    assert torch.equal(target["model"]["u"].to_full(), w[:3])
    assert torch.equal(target["model"]["b"], torch.ones(3))
    assert target["extra"] == {"epoch": 5, "lr": [0.1]}
    # the checkpoint is plain DCP to DCP's default planner: into plain tensors
    plain = {"model": {"w": torch.zeros(5, 6), "u": torch.zeros(3, 6)}}
    dcp.load(plain, storage_reader=reader())
    assert torch.equal(plain["model"]["w"], w) and torch.equal(plain["model"]["u"], w[:3])
    # and a plain DCP checkpoint loads into sharded tensors
    dcp.save({"w": w * 2}, storage_writer=CkptStorageWriter(str(tmp_path / "plain")))
    into = {"w": CpuShardedTensor(torch.zeros(5, 6), (2, 2), (1, 0))}
    dcp.load(into, storage_reader=CkptStorageReader(str(tmp_path / "plain")),
             planner=SpmdLoadPlanner())
    assert torch.equal(into["w"].to_full(), w * 2)


def test_spmd_load_planner_refuses_foreign_pickle_unless_trusted(tmp_path: Path) -> None:
    dcp.save({"o": Opaque(1), "t": torch.ones(1)},
             storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    with pytest.raises(CheckpointException) as info:
        dcp.load({"o": None, "t": torch.zeros(1)},
                 storage_reader=dcp.FileSystemReader(str(tmp_path)), planner=SpmdLoadPlanner())
    assert isinstance(_failure(info.value), UnsafeCheckpointError)
    target: dict[str, Any] = {"o": None, "t": torch.zeros(1)}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path)),
             planner=SpmdLoadPlanner(trusted=True))
    assert target["o"].x == 1


# ---------------------------------------------------------------------- several processes


def _dtensor_save(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.arange(10 * 20, dtype=torch.float32).reshape(10, 20)
    state = {"rows": distribute_tensor(g, mesh, [Shard(0)]),  # 10 rows over 2 ranks
             "replicated": distribute_tensor(g[0], mesh, [Replicate()]),
             "tiny": distribute_tensor(g[:1, :4], mesh, [Shard(0)]),  # rank 1's shard is empty
             "plain": torch.arange(7.0),
             "extra": {"step": 5, "tags": ["a", "b"]}}
    dcp.save(state, storage_writer=CkptStorageWriter(path))


def _dtensor_load(rank: int, world: int, path: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.arange(10 * 20, dtype=torch.float32).reshape(10, 20)
    state = {"rows": distribute_tensor(torch.zeros(10, 20), mesh, [Shard(1)]),  # now columns
             "replicated": distribute_tensor(torch.zeros(20), mesh, [Shard(0)]),
             "tiny": distribute_tensor(torch.zeros(1, 4), mesh, [Shard(1)]),
             "plain": torch.zeros(7), "extra": {"step": 0, "tags": []}}
    dcp.load(state, storage_reader=CkptStorageReader(path))
    return bool(torch.equal(state["rows"].full_tensor(), g)
                and torch.equal(state["replicated"].full_tensor(), g[0])
                and torch.equal(state["tiny"].full_tensor(), g[:1, :4])
                and torch.equal(state["plain"], torch.arange(7.0))
                and state["extra"] == {"step": 5, "tags": ["a", "b"]})


def test_reshard_across_world_sizes(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(_dtensor_save, 2, path)
    md = CkptStorageReader(path).read_metadata()
    assert len(md.state_dict_metadata["rows"].chunks) == 2  # type: ignore[union-attr]
    assert run_ranks(_dtensor_load, 3, path) == [True, True, True]
    # one process, plain tensors
    g = torch.arange(10 * 20, dtype=torch.float32).reshape(10, 20)
    state = {"rows": torch.zeros(10, 20), "replicated": torch.zeros(20)}
    _load(state, path)
    assert torch.equal(state["rows"], g) and torch.equal(state["replicated"], g[0])


def _specs() -> list[Any]:
    from torch.distributed._shard.sharding_spec import (
        ChunkShardingSpec,
        EnumerableShardingSpec,
        ShardMetadata,
    )

    def rows(*parts: tuple[int, int, int]) -> Any:
        return EnumerableShardingSpec([ShardMetadata([o, 0], [n, 20], f"rank:{r}/cpu")
                                       for o, n, r in parts])

    return [ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"]),
            ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu", "rank:1/cpu",
                                                 "rank:0/cpu"]),
            ChunkShardingSpec(dim=1, placements=["rank:0/cpu", "rank:1/cpu"]),
            rows((0, 2, 0), (2, 1, 1), (3, 3, 0), (6, 3, 1), (9, 1, 0)),
            rows((0, 8, 1), (8, 2, 0))]


def _sharded(spec: Any, g: torch.Tensor | None) -> Any:
    from torch.distributed._shard import sharded_tensor

    st = sharded_tensor.zeros(spec, 10, 20)
    if g is not None:
        for shard in st.local_shards():
            o, s = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            shard.tensor.copy_(g[o[0]:o[0] + s[0], o[1]:o[1] + s[1]])
    return st


def _matches(st: Any, g: torch.Tensor) -> bool:
    """Whether every local shard of ShardedTensor ``st`` holds its box of ``g``."""
    for shard in st.local_shards():
        (r, c), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if not torch.equal(shard.tensor, g[r:r + nr, c:c + nc]):
            return False
    return True


def _shard_plans(rank: int, world: int, path: str) -> list[str]:
    """PyTorch's test_load_with_different_shard_plan, rowwise-to-colwise and switching between
    sharded and plain tensors: every pair of shard plans, saved again and again into one
    directory."""
    wrong = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # ShardedTensor is deprecated for DTensor
        specs = _specs()
        for i, s0 in enumerate(specs):
            for j, s1 in enumerate(specs):
                if i == j:
                    continue
                g = torch.randn(10, 20, generator=torch.Generator().manual_seed(10 * i + j))
                saved = {"sharded": _sharded(s0, g), "replicated": g.clone()}
                dcp.save(saved, storage_writer=CkptStorageWriter(path))
                # another shard plan; the plain (replicated) tensor into a sharded one
                loaded = {"sharded": _sharded(s1, None), "replicated": _sharded(s1, None)}
                dcp.load(loaded, storage_reader=CkptStorageReader(path))
                # the sharded one into a plain tensor
                plain = {"sharded": torch.zeros(10, 20)}
                dcp.load(plain, storage_reader=CkptStorageReader(path))
                if not (_matches(loaded["sharded"], g) and _matches(loaded["replicated"], g)
                        and torch.equal(plain["sharded"], g)):
                    wrong.append(f"{i}->{j}")
        dist.barrier()
    return wrong


def test_shard_plans_saved_into_one_directory(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    assert run_ranks(_shard_plans, 2, path, timeout_s=240) == [[], []]
    assert len(_data_files(Path(path))) <= 2  # one attempt's files: the last save's


def _values_on_ranks(rank: int, world: int, path: str) -> tuple[Any, Any]:
    dcp.save({"bytes0": [1], "bytes1": "string"}, storage_writer=CkptStorageWriter(path))
    target = {"bytes0": [2], "bytes1": "other"}
    dcp.load(target, storage_reader=CkptStorageReader(path))
    return target["bytes0"], target["bytes1"]


def test_values_on_every_rank(tmp_path: Path) -> None:
    assert run_ranks(_values_on_ranks, 2, str(tmp_path / "c")) == [([1], "string")] * 2


def _one_rank_fails(rank: int, world: int, path: str) -> list[str]:
    dcp.save({"w": torch.full((4,), float(rank))}, storage_writer=CkptStorageWriter(path))
    out = []
    # rank 1 holds an object that needs pickle (its write fails); so every rank fails
    state: dict[str, Any] = {"w": torch.zeros(4), "o": Opaque(1) if rank == 1 else 1}
    try:
        dcp.save(state, storage_writer=CkptStorageWriter(path))
    except CheckpointException as e:
        out += [f"{r}:{type(f[0] if isinstance(f, tuple) else f).__name__}"
                for r, f in sorted(e.failures.items())]
    # and the coordinator's commit failing is seen on every rank too
    writer = CkptStorageWriter(path)
    if rank == 0:
        def fail(*args: Any, **kwargs: Any) -> None:
            raise ValueError("fail_finish")
        writer.finish = fail  # type: ignore[method-assign]
    try:
        dcp.save({"w": torch.zeros(4)}, storage_writer=writer)
    except CheckpointException as e:
        out += [f"{r}:{type(f[0] if isinstance(f, tuple) else f).__name__}"
                for r, f in sorted(e.failures.items())]
    target = {"w": torch.full((4,), 9.0)}
    dcp.load(target, storage_reader=CkptStorageReader(path))
    out.append(str(target["w"].tolist()))
    return out


def test_a_rank_failing_fails_every_rank_and_commits_nothing(tmp_path: Path) -> None:
    got = run_ranks(_one_rank_fails, 2, str(tmp_path / "c"))
    # the first save (the replicated "w" written once) is what every rank still reads
    assert got[0] == got[1]
    assert got[0][:2] == ["1:UnsafeCheckpointError", "0:ValueError"]
    assert got[0][2] in ("[0.0, 0.0, 0.0, 0.0]", "[1.0, 1.0, 1.0, 1.0]")


def _spmd_two_hosts(rank: int, world: int, path: str, storage: str) -> None:
    # a 2x2 mesh over two hosts (two devices each), rows across hosts, the tiled tensor uneven
    local = [2 * rank, 2 * rank + 1]
    w = torch.arange(35.0).reshape(5, 7)
    state = {"model": {"tiled": CpuShardedTensor(w, (2, 2), (0, 1), local_devices=local),
                       "partial": CpuShardedTensor(w, (2, 2), (None, 1), local_devices=local)},
             "step": 3}
    writer = CkptStorageWriter(path) if storage == "ckptmgr" else dcp.FileSystemWriter(path)
    dcp.save(state_dict=state, storage_writer=writer, planner=SpmdSavePlanner())


@pytest.mark.parametrize("storage", ["ckptmgr", "dcp-filesystem"])
def test_spmd_planners_across_hosts(tmp_path: Path, storage: str) -> None:
    path = str(tmp_path / "c")
    run_ranks(_spmd_two_hosts, 2, path, storage)
    w = torch.arange(35.0).reshape(5, 7)
    target = {"model": {"tiled": CpuShardedTensor(torch.zeros(5, 7), (4,), (None, 0)),
                        "partial": CpuShardedTensor(torch.zeros(5, 7), (1,), (None, None))},
              "step": 0}
    reader = CkptStorageReader(path) if storage == "ckptmgr" else dcp.FileSystemReader(path)
    dcp.load(state_dict=target, storage_reader=reader, planner=SpmdLoadPlanner())
    assert torch.equal(target["model"]["tiled"].to_full(), w)
    assert torch.equal(target["model"]["partial"].to_full(), w)
    assert target["step"] == 3



def test_a_stale_cached_plan_never_overwrites_the_committed_files(ckpt: Path) -> None:
    planner = DefaultSavePlanner(enable_plan_caching=True)
    dcp.save({"w": torch.ones(4)}, storage_writer=CkptStorageWriter(str(ckpt)), planner=planner)
    committed = {n: (ckpt / n).read_bytes() for n in os.listdir(ckpt)}
    with pytest.raises(CheckpointException, match="earlier save's plan"):
        dcp.save({"w": torch.zeros(4)}, storage_writer=CkptStorageWriter(str(ckpt)),
                 planner=planner)
    assert {n: (ckpt / n).read_bytes() for n in os.listdir(ckpt)} == committed
    target = {"w": torch.zeros(4)}
    _load(target, str(ckpt))
    assert torch.equal(target["w"], torch.ones(4))


def test_spmd_load_planner_puts_values_back_under_int_keys(ckpt: Path) -> None:
    # An optimizer's state is keyed by int; DCP's flattening records the key as "0".
    _save({"optim": {"state": {0: {"count": 5, "buf": torch.ones(2)}},
                     "param_groups": [{"lr": 0.5, "params": [0]}]}}, str(ckpt))
    target = {"optim": {"state": {0: {"count": 0, "buf": torch.zeros(2)}},
                        "param_groups": [{"lr": 0.1, "params": [0]}]}}
    dcp.load(target, storage_reader=CkptStorageReader(str(ckpt)), planner=SpmdLoadPlanner())
    assert target["optim"]["state"] == {0: {"count": 5, "buf": target["optim"]["state"][0]["buf"]}}
    assert torch.equal(target["optim"]["state"][0]["buf"], torch.ones(2))
    assert target["optim"]["param_groups"] == [{"lr": 0.5, "params": [0]}]
