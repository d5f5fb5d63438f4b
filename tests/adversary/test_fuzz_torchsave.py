"""Fuzzing ``torch.save`` files read by ``load_initial`` (``.pt``/``.pth``/``.bin``).

Valid files are real ``torch.save`` output, zip and legacy formats. Cases: byte-level mutations of
the whole file, and mutations of one member of the zip archive re-zipped with valid CRCs (so the
bytes reach the unpickler and the storages). Property (tests/_fuzz.py): the state holds what
``torch.load(weights_only=True)`` reads from the same bytes (cast to the state's dtypes), or a
CkptmgrError is raised; a file that torch cannot read never loads; within the bounds.
"""

from __future__ import annotations

import pickletools
import struct
from typing import Any

from _fuzz import (  # noqa: F401 - sandbox_fixture and templates_fixture are fixtures
    EXTREME_INT64,
    Sandbox,
    byte_mutations,
    check,
    fuzz_settings,
    rezip,
    sandbox_fixture,
    templates_fixture,
    zip_members,
)
from hypothesis import given
from hypothesis import strategies as st


def _run(sandbox: Sandbox, t: dict[str, Any], data: bytes, name: str, ops: Any) -> None:
    out = sandbox.run("torch_file", data=data, name=name, flat=t["flat"])
    check(out, "torch-save", data=data, ops=ops)


@fuzz_settings(30)
@given(data=st.data())
def test_mutated_torch_file(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                            data: st.DataObject) -> None:
    t = fuzz_templates
    m = data.draw(byte_mutations([t["torch_zip"], t["torch_legacy"]]), label="mutation")
    name = data.draw(st.sampled_from(("model.pt", "pytorch_model.bin")), label="name")
    _run(fuzz_sandbox, t, m.data, name, m.ops)


def _pickle_ints(pkl: bytes) -> list[tuple[int, int, str]]:
    """(position, length, opcode) of every small integer literal in a pickle: the sizes,
    strides, offsets and storage lengths of the tensors it rebuilds."""
    out = []
    for op, arg, pos in pickletools.genops(pkl):
        if op.name in ("BININT1", "BININT2", "BININT") and isinstance(arg, int) and pos is not None:
            out.append((pos, {"BININT1": 2, "BININT2": 3, "BININT": 5}[op.name], op.name))
    return out


@fuzz_settings(30)
@given(data=st.data())
def test_mutated_zip_member(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                            data: st.DataObject) -> None:
    """One member of the archive mutated, the archive rebuilt with valid CRCs: the pickle's
    integers (shapes, strides, storage offsets and sizes) set to extremes, or any member's bytes
    mutated (data.pkl, a storage, byteorder, version)."""
    t = fuzz_templates
    members = zip_members(t["torch_zip"])
    names = [info.filename for info, _ in members]
    target = data.draw(st.sampled_from(names), label="member")
    k = names.index(target)
    info, raw = members[k]
    if target.endswith("data.pkl") and data.draw(st.booleans(), label="pickle ints"):
        ints = _pickle_ints(raw)
        new = bytearray(raw)
        ops = []
        for _ in range(data.draw(st.integers(1, 3))):
            pos, length, op = data.draw(st.sampled_from(ints))
            value = data.draw(st.sampled_from(EXTREME_INT64))
            # BININT holds 4 signed bytes: a wider value becomes its low 32 bits there.
            v32 = value & 0xFFFFFFFF
            new[pos:pos + length] = b"J" + struct.pack("<I", v32)
            ops.append(f"{target}: integer at {pos} ({op}) = BININT {v32:#x}")
            ints = _pickle_ints(bytes(new)) if _parses(bytes(new)) else ints
        raw = bytes(new)
    else:
        m = data.draw(byte_mutations([raw]), label="member mutation")
        raw = m.data
        ops = [f"{target}: {o}" for o in m.ops[1:]]
    members[k] = (info, raw)
    _run(fuzz_sandbox, t, rezip(members), "model.pt", ops)


def _parses(pkl: bytes) -> bool:
    try:
        list(pickletools.genops(pkl))
    except Exception:  # any damage: keep the previous positions
        return False
    return True


def test_torch_file_cases(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any]) -> None:
    """Explicit cases: empty, a zip with no data.pkl, a pickle that is not weights-only, a
    legacy file cut inside its storage bytes."""
    t = fuzz_templates
    members = zip_members(t["torch_zip"])
    no_pkl = rezip([(i, r) for i, r in members if not i.filename.endswith("data.pkl")])
    evil = rezip([(i, b"cos\nsystem\n(S'true'\ntR." if i.filename.endswith("data.pkl") else r)
                  for i, r in members])
    cut = t["torch_legacy"][:-20]
    for name, raw in (("empty", b""), ("no data.pkl", no_pkl), ("os.system", evil),
                      ("legacy cut", cut), ("text", b"hello\n")):
        _run(fuzz_sandbox, t, raw, "model.pt", [name])
