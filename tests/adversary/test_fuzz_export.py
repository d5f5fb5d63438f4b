"""Fuzzing ``export --format hf`` (``ckptmgr/tools/export.py``): crafted metadata, and faults.

The export reads the same metadata as a restore, but assembles tensors itself (chunks of a
sharded tensor into one buffer) and writes into a directory the user owns. Two attacks:

- the step's metadata is mutated or its chunk lists crafted (duplicated, overlapping, missing,
  overflowing chunks, each pointing at true bytes with true checksums), with the manifest
  re-signed so the parser is reached. Property: the export raises one of our errors and leaves
  the output directory as it was, or it writes exactly the saved tensors (a duplicated chunk
  must not export uninitialised memory: Trust I defect 4);
- an I/O failure is injected at the n-th file operation of the export (a storage read fails
  with ``StorageError``; creating, writing or fsyncing a temporary file, a hard link or a rename
  with ``ENOSPC``). Property: our error, and the output directory, pre-populated with the user's
  files at the export's own names and beside them, byte-identical to what it was (a failed
  export deleted the user's shards: Trust I defect 4). Clean-up calls (``unlink``, ``rmdir``)
  are not failed: one fault per export, and the clean-up of a fault is what is under test.

The cases run in the fuzz sandbox (tests/_fuzz.py); the target is :func:`target_export`.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from _fuzz import (  # noqa: F401 - sandbox_fixture and templates_fixture are fixtures
    OracleError,
    Sandbox,
    _fresh_copy,
    _write_and_fix,
    check,
    compare_state,
    crafted_chunks_metadata,
    framed_mutations,
    fuzz_settings,
    join_v2,
    ref_safetensors,
    sandbox_fixture,
    saved_state,
    split_v2,
    templates_fixture,
)
from hypothesis import given
from hypothesis import strategies as st

MAX_SHARD = 64
"""Bytes per shard: the template's model tensors (b 32, h 30, i 40, w 96 bytes) make 3 shards."""
_USER = {f"model-0000{k}-of-00003.safetensors": f"user shard {k}\n".encode() for k in (1, 2, 3)}
_USER.update({"model-00001-of-00001.safetensors": b"user single shard\n",
              "model.safetensors.index.json": b'{"user": "index"}\n',
              "config.json": b'{"model_type": "user"}\n'})
"""What the user's output directory holds before each export: files at the export's own names
(both shard counts it can pick) and one beside them."""


def _snapshot(d: str) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(d)):
        with open(os.path.join(d, name), "rb") as f:
            out[name] = f.read()
    return out


class _Fault:
    """Counts the export's file operations; the ``at``-th fails with ENOSPC (one fault)."""

    def __init__(self, at: int | None) -> None:
        self.at, self.n, self.hit, self.done = at, 0, "", False

    def tick(self, what: str, storage: bool = False) -> None:
        if self.done:  # the export has returned: the harness's own operations never fail
            return
        self.n += 1
        if self.n == self.at:
            self.hit = f"{what} (operation {self.n})"
            if storage:  # what the storage layer raises for a failed read (its contract)
                from ckptmgr.errors import StorageError

                raise StorageError(f"read failed (injected at {what})")
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {what})")


class _File:
    """A file object whose writes, flushes and fsyncs go through the fault counter."""

    def __init__(self, f: Any, fault: _Fault) -> None:
        self._f, self._fault = f, fault

    def write(self, b: Any) -> int:
        self._fault.tick("write")
        n: int = self._f.write(b)
        return n

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _inject(fault: _Fault, out_dir: str) -> None:
    """(in the child) Route the export's file operations through ``fault``. The child is thrown
    away after the case: nothing is put back."""
    from ckptmgr.storage import local

    def wrap(owner: Any, name: str, what: str, only_out: bool = False,
             storage: bool = False) -> None:
        real = getattr(owner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if not only_out or (args and str(args[0]).startswith(out_dir)):
                fault.tick(what, storage)
            return real(*args, **kwargs)

        setattr(owner, name, call)

    wrap(local.LocalStorage, "read_into", "a storage read", storage=True)
    wrap(os, "open", "creating a file", only_out=True)
    wrap(os, "fsync", "fsync")
    wrap(os, "link", "a hard link")
    wrap(os, "replace", "a rename")
    real_fdopen = os.fdopen
    os.fdopen = lambda *a, **k: _File(real_fdopen(*a, **k), fault)  # type: ignore[assignment]


def target_export(root: str, step: int, edits: Mapping[str, bytes | None],
                  fault_at: int | None = None) -> dict[str, Any]:
    """Export step ``step`` of a copy of ``root`` (its step directory given ``edits``, the
    manifest re-signed) into a directory pre-populated with the user's files; the ``fault_at``-th
    file operation fails. Oracle: a returned export holds exactly the saved model tensors and
    left the user's other files alone, nothing else behind; a failed one left the directory
    byte-identical."""
    from ckptmgr import tools

    root = _fresh_copy(root)
    _write_and_fix(os.path.join(root, str(step)), edits)
    out_dir = os.path.join(tempfile.mkdtemp(), "hf")
    os.makedirs(out_dir)
    for name, data in _USER.items():
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(data)
    before = _snapshot(out_dir)
    fault = _Fault(fault_at)
    if fault_at is not None:
        _inject(fault, out_dir)
    try:
        try:
            result = tools.export_hf(root, step, out_dir, max_shard_size=MAX_SHARD,
                                     prefix="model.")
        finally:
            fault.done = True
    except BaseException as e:
        after = _snapshot(out_dir)
        if after != before:
            changed = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
            raise OracleError(f"the export failed ({type(e).__name__}: {e}; fault: "
                              f"{fault.hit or 'none'}), and changed the output directory: "
                              f"{changed}") from e
        raise
    after = _snapshot(out_dir)
    written = {*result.shards, os.path.basename(result.index)}
    problems = [f"{n}: the user's file changed" for n in before
                if n not in written and after.get(n) != before[n]]
    problems += [f"{n}: left behind" for n in after if n not in written and n not in before]
    problems += [f"{n}: missing" for n in written if n not in after]
    got: dict[str, Any] = {}
    for name in result.shards:
        for k, v in ref_safetensors(after.get(name, b"")).items():
            if isinstance(v, str):
                problems.append(f"{name}: entry {k!r} is not valid: {v}")
            got[k] = v
    index = json.loads(after.get(os.path.basename(result.index), b"{}"))
    want = saved_state()["model"]
    if sorted(index.get("weight_map", {})) != sorted(want):
        problems.append(f"index weight_map names {sorted(index.get('weight_map', {}))}")
    problems += compare_state(got, want)
    if problems:
        raise OracleError(f"the export returned (fault: {fault.hit or 'none'}), but:\n"
                          + "\n".join(problems[:20]))
    return {"shards": list(result.shards), "ops": fault.n}


_TARGET = "adversary.test_fuzz_export:target_export"


def _export(sandbox: Sandbox, t: Mapping[str, Any], meta: bytes | None, what: str,
            ops: Sequence[str], fault_at: int | None = None) -> None:
    edits = {} if meta is None else {t["metadata_name"]: meta}
    out = sandbox.run(_TARGET, root=t["root_v2"], step=1, edits=edits, fault_at=fault_at)
    check(out, what, data=meta, ops=ops)


# Trust I defect 4's cases: a duplicated chunk (the element count adds up), and its relatives.
_CRAFTED = [
    ("model.b", [((0,), (4,)), ((0,), (4,))], 2),
    ("model.w", [((0, 0), (2, 6)), ((0, 0), (2, 6))], 2),
    ("model.b", [((0,), (4,)), ((0,), (4,))], 1),
    ("model.b", [((0,), (8,)), ((2**62,), (2**62,))], 2),
    ("model.b", [((0,), (6,)), ((4,), (4,))], 2),  # overlap, one past the end
    ("model.b", [((0,), (4,))], 2),  # a gap
]


@pytest.mark.parametrize(("fqn", "chunks", "fmt"), _CRAFTED)
def test_crafted_chunk_list_cases(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                                  fqn: str, chunks: list[Any], fmt: int) -> None:
    t = fuzz_templates
    meta = crafted_chunks_metadata(t["root_v2"], 1, t["metadata_name"], fqn, chunks, fmt, "q")
    _export(fuzz_sandbox, t, meta, f"export-chunks-v{fmt}", [f"{fqn} chunks = {chunks}"])


_EXTREME = st.sampled_from((2**62, 2**63 - 1, -1, 2**32))


@fuzz_settings(25)
@given(data=st.data())
def test_crafted_chunk_lists(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                             data: st.DataObject) -> None:
    """Drawn chunk lists of one tensor (duplicates, overlaps, gaps, overflowing sums), true bytes
    and checksums behind each chunk: only an exact tiling may export, and then bit-exact."""
    t = fuzz_templates
    fqn = data.draw(st.sampled_from(("model.b", "model.w")), label="tensor")
    rows, cols = (8, None) if fqn == "model.b" else (4, 6)
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for _ in range(data.draw(st.integers(1, 4), label="chunks")):
        small = st.integers(0, rows)
        off = data.draw(st.one_of(small, small, small, _EXTREME))
        size = data.draw(st.one_of(small, small, _EXTREME))
        chunks.append(((off,), (size,)) if cols is None else ((off, 0), (size, cols)))
    fmt = data.draw(st.sampled_from((2, 2, 1)), label="format")
    meta = crafted_chunks_metadata(t["root_v2"], 1, t["metadata_name"], fqn, chunks, fmt,
                                   data.draw(st.sampled_from(("q", "r")), label="column"))
    _export(fuzz_sandbox, t, meta, f"export-chunks-v{fmt}", [f"{fqn} chunks = {chunks}"])


@fuzz_settings(15)
@given(data=st.data())
def test_mutated_metadata(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                          data: st.DataObject) -> None:
    """Byte and structure mutations of the format-2 metadata (re-framed or not)."""
    t = fuzz_templates
    m = data.draw(framed_mutations([t["metadata_v2"]], split_v2, join_v2, body_int64=True),
                  label="mutation")
    _export(fuzz_sandbox, t, m.data, "export-metadata-v2", m.ops)


@fuzz_settings(20)
@given(at=st.integers(1, 32))
def test_fault_at_a_random_point(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                                 at: int) -> None:
    """ENOSPC at the ``at``-th file operation of an export of a good step over the user's files
    (an export of the template takes 30: beyond that it succeeds)."""
    _export(fuzz_sandbox, fuzz_templates, None, "export-fault", [f"fault at operation {at}"],
            fault_at=at)


def test_checksum_failure_in_the_last_shard(fuzz_sandbox: Sandbox,
                                            fuzz_templates: dict[str, Any]) -> None:
    """A damaged data file (one flipped byte in the last tensor exported, ``w``, re-signed in
    the manifest): the export fails after two shards are written, and the user's files stay."""
    t = fuzz_templates
    header, _ = split_v2(t["metadata_v2"])
    entry = next(e for e in header["tensors"] if e["fqn"] == "model.w")
    pos = entry["loc"]["pos"]["c"] + 5
    data = bytearray(t["data"])
    data[pos] ^= 0x40
    out = fuzz_sandbox.run(_TARGET, root=t["root_v2"], step=1, edits={t["data_name"]: bytes(data)})
    check(out, "export-damaged", ops=[f"flip byte {pos} of {t['data_name']}"])
