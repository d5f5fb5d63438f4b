"""Fuzzing config YAML (``CheckpointManager.from_config(path)``, ``ckptmgr/config.py``).

``from_config`` reads the file with :func:`ckptmgr.config.load_config`, then builds the manager;
the fuzz cases stop before the manager (a mutated ``path`` must not create directories anywhere
on the machine): ``load_config``, the keyword arguments it gives the constructor, and its repr.
Cases start from the repository's own ``configs/*.yaml``. Property (tests/_fuzz.py): a config, or
ConfigError, within the bounds: YAML alias bombs and deep nesting included.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from _fuzz import (  # noqa: F401 - sandbox_fixture and templates_fixture are fixtures
    Sandbox,
    _Raw,
    byte_mutations,
    check,
    fuzz_settings,
    json_mutations,
    sandbox_fixture,
    templates_fixture,
)
from hypothesis import given
from hypothesis import strategies as st


def _dump_yaml(doc: Any) -> bytes:
    """``doc`` as YAML, :class:`_Raw` nodes written as flow-style text."""
    raws: list[str] = []

    def enc(o: Any) -> Any:
        if isinstance(o, _Raw):
            raws.append(o.text)
            return f"RAW{len(raws) - 1}RAW"
        if isinstance(o, dict):
            return {k: enc(v) for k, v in o.items()}
        if isinstance(o, list):
            return [enc(v) for v in o]
        return o

    text = yaml.safe_dump(enc(doc), allow_unicode=True, sort_keys=False, width=1 << 20)
    for i, raw in enumerate(raws):
        text = text.replace(f"RAW{i}RAW", raw)
    return text.encode("utf-8", "surrogatepass")


@fuzz_settings(50)
@given(data=st.data())
def test_mutated_config(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any],
                        data: st.DataObject) -> None:
    configs = fuzz_templates["configs"]
    name = data.draw(st.sampled_from(sorted(configs)), label="config")
    if data.draw(st.booleans(), label="structure-aware"):
        ops, doc = data.draw(json_mutations(yaml.safe_load(configs[name])), label="mutation")
        raw = _dump_yaml(doc)
        ops = (f"start from configs/{name}", *ops)
    else:
        m = data.draw(byte_mutations([configs[name], *configs.values()]), label="mutation")
        raw, ops = m.data, (f"configs/{name} first", *m.ops)
    out = fuzz_sandbox.run("config", text=raw)
    check(out, "config", data=raw, ops=ops)


def _bomb(levels: int, width: int = 9) -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines)


# Where a bomb goes: a field whose error message names the value, the free-form mapping, a list.
_FIELDS = ("save_interval", "storage.options.key", "preemption.signals")


@pytest.mark.parametrize("field", _FIELDS)
def test_alias_bomb(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any], field: str) -> None:
    """A billion laughs: 9**9 references built from a few hundred bytes, placed at one field.
    YAML shares them, but anything that walks or prints the value (validation, an error message
    naming the value, a repr) expands them."""
    base = yaml.safe_load(fuzz_templates["configs"]["local.yaml"])
    doc = copy.deepcopy(base)
    node = doc
    *parents, last = field.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = "BOMB"
    text = _dump_yaml(doc).decode().replace("BOMB", "*a8")
    raw = (_bomb(9) + "\n" + text).encode()
    out = fuzz_sandbox.run("config", text=raw, timeout=15)
    check(out, "config-bomb", data=raw, ops=[f"{field} = a 9-level alias bomb"])


@pytest.mark.parametrize("depth", [100, 1000, 100_000])
@pytest.mark.parametrize("style", ["flow-list", "flow-map", "block"])
def test_deep_nesting(fuzz_sandbox: Sandbox, fuzz_templates: dict[str, Any], depth: int,
                      style: str) -> None:
    """Deep nesting at ``storage.options`` (the one free-form mapping of the config)."""
    if style == "flow-list":
        value = "[" * depth + "]" * depth
    elif style == "flow-map":
        value = "{a: " * depth + "1" + "}" * depth
    else:
        value = "".join(f"\n{'  ' * (i + 2)}k:" for i in range(min(depth, 3000))) + " 1"
    raw = (f"path: ./x\nsave_interval: 1\nstorage:\n  options:{' ' if style != 'block' else ''}"
           f"{value}\n").encode()
    out = fuzz_sandbox.run("config", text=raw, timeout=60)
    check(out, "config-deep", data=raw if len(raw) < 10_000 else None,
          ops=[f"storage.options nested {depth} deep ({style})"])


_CASES = {
    "python-object-tag": b"!!python/object/apply:os.system ['true']",
    "python-name-tag": b"save_interval: !!python/name:os.system\n",
    "not-utf8": b"\xff\xfe",
    "duplicate-key": b"path: x\nsave_interval: 1\nsave_interval: 2\n",
    "top-level-list": b"- 1\n- 2\n",
    "empty": b"",
    "float-overflow": b"path: x\nsave_interval: 1e400\n",
    "nan": b"path: x\nsave_interval: .nan\n",
    "huge-hex": b"path: x\nsave_interval: 0x7fffffffffffffffffff\n",
    "nul-in-path": b'path: "\\0"\nsave_interval: 1\n',
    "merge-key": b"<<: {path: x, save_interval: 1}\n",
    "complex-key": b"? [a, b]\n: 1\n",
    "null-key-only": b"\n?",
    "int-key-top": b"1: 2\npath: x\n",
    "int-key-section": b"path: x\nsave_interval: 1\nretention: {1: 2}\n",
    "null-key": b"path: x\nsave_interval: 1\n? null\n",
}


@pytest.mark.parametrize("text", list(_CASES.values()), ids=list(_CASES))
def test_config_cases(fuzz_sandbox: Sandbox, text: bytes) -> None:
    out = fuzz_sandbox.run("config", text=text)
    check(out, "config-case", data=text, ops=[repr(text)])
