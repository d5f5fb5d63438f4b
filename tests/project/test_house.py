"""House checks: the pinned public surface and the one-way layering of DESIGN.md section 3."""

from __future__ import annotations

import ast
from pathlib import Path

import ckptmgr
import ckptmgr.errors as errors

PKG = Path(ckptmgr.__file__).resolve().parent

PUBLIC = [
    "AsyncSaveError", "BackendNotInstalledError", "CheckpointExistsError", "CheckpointManager",
    "CheckpointNotFoundError", "CkptmgrError", "ConfigError", "CorruptCheckpointError",
    "FileEntry", "IncompleteCheckpointError", "ManagerConfig", "RNGState", "RestoreError",
    "SaveError",
    "SaveStats", "StateMismatchError", "StepInfo", "StorageError", "UnsafeCheckpointError",
    "__version__", "prime_optimizer",
]


def test_public_all_is_pinned_and_sorted() -> None:
    assert ckptmgr.__all__ == sorted(ckptmgr.__all__)
    assert ckptmgr.__all__ == PUBLIC
    for name in PUBLIC:
        assert hasattr(ckptmgr, name), name


def test_error_tree() -> None:
    e = errors
    expected = {
        e.ConfigError: (e.CkptmgrError, ValueError),
        e.BackendNotInstalledError: (e.CkptmgrError, ImportError),
        e.StorageError: (e.CkptmgrError, OSError),
        e.CheckpointNotFoundError: (e.CkptmgrError, LookupError),
        e.IncompleteCheckpointError: (e.CheckpointNotFoundError,),
        e.CheckpointExistsError: (e.CkptmgrError, FileExistsError),
        e.LeaseError: (e.CkptmgrError, RuntimeError),
        e.SaveError: (e.CkptmgrError, RuntimeError),
        e.AsyncSaveError: (e.SaveError,),
        e.RestoreError: (e.CkptmgrError, RuntimeError),
        e.StateMismatchError: (e.RestoreError, ValueError),
        e.CorruptCheckpointError: (e.RestoreError,),
        e.UnsafeCheckpointError: (e.RestoreError,),
    }
    for cls, bases in expected.items():
        for base in bases:
            assert issubclass(cls, base), (cls, base)
        assert cls.__name__ in (errors.__doc__ or ""), f"{cls.__name__} missing from the drawn tree"
    assert issubclass(e.CkptmgrError, Exception)
    assert sorted(errors.__all__) == sorted(c.__name__ for c in [*expected, e.CkptmgrError])
    err = e.SaveError("x", step=3, failures={1: ValueError("y")})
    assert err.step == 3 and isinstance(err.failures[1], ValueError)


# Lower numbers are lower layers; a module may import only its own layer or lower ones.
LAYERS = {
    "errors": 0, "_version": 0, "_redact": 0, "_gc": 0, "_exit": 0, "_threads": 0,
    "codec": 1, "policy": 1, "config": 1, "info": 1,
    "events": 1, "progress": 1,
    "storage": 2, "step_store": 2, "lease": 2, "_arrivals": 2, "_shm": 2,
    "dcp": 3, "optim": 3, "rng": 3,
    "_dist": 4, "formats": 4,
    "_async": 5, "preemption": 5, "durable": 5, "local_tier": 5, "replicas": 5, "initial": 5,
    "writer_process": 5, "_save_on_close": 5, "_save_path": 5, "uploader": 5,
    "manager": 6, "tools": 6,
    "cli": 7, "integrations": 7, "__init__": 8, "__main__": 8,
}
PURE = {"errors", "_gc", "_exit", "_redact", "_threads", "_version", "codec", "policy", "config",
        "info", "events", "progress"}


def _layer_of(parts: list[str]) -> tuple[str, int]:
    top = parts[0] if parts else "__init__"
    assert top in LAYERS, f"module ckptmgr.{top} has no layer in tests/project/test_house.py"
    return top, LAYERS[top]


def _imports(tree: ast.AST) -> list[str]:
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def test_imports_flow_down() -> None:
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("").parts
        name, layer = _layer_of(list(rel))
        for mod in _imports(ast.parse(path.read_text())):
            root = mod.split(".")[0]
            if name in PURE and root in ("torch", "fsspec", "torch_xla"):
                problems.append(f"pure module {'/'.join(rel)} imports {mod}")
            if root == "fsspec" and name != "storage":
                problems.append(f"{'/'.join(rel)} imports fsspec (only ckptmgr.storage may)")
            if root in ("gcsfs", "s3fs"):
                problems.append(f"{'/'.join(rel)} imports {root} directly")
            if root == "torch_xla" and rel != ("dcp", "xla"):
                problems.append(f"{'/'.join(rel)} imports torch_xla (only ckptmgr/dcp/xla.py may)")
            if root == "ckptmgr" and mod != "ckptmgr":
                _, tlayer = _layer_of(mod.split(".")[1:])
                if tlayer > layer:
                    problems.append(f"{'/'.join(rel)} (layer {layer}) imports {mod} "
                                    f"(layer {tlayer})")
    assert not problems, "\n".join(problems)


def test_torch_xla_is_imported_lazily() -> None:
    # Importing ckptmgr (manager, planners, the XLA adapter module itself) must not import
    # torch_xla: only a state holding XLA tensors does.
    import subprocess
    import sys

    code = ("import sys, ckptmgr, ckptmgr.dcp.xla, ckptmgr.dcp.spmd; "
            "assert 'torch_xla' not in sys.modules, 'torch_xla imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _ckptmgr_imports(path: Path) -> list[str]:
    """Every ckptmgr module ``path`` imports (``from a import b`` counts ``a.b`` when it is a
    module), wherever the import statement is (function-level imports too)."""
    modules = {_module_name(p) for p in PKG.rglob("*.py")}
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("ckptmgr")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and (
                node.module.startswith("ckptmgr")):
            subs = [f"{node.module}.{a.name}" for a in node.names]
            found = [m for m in subs if m in modules]
            out += found if found else [node.module]
    return out


def test_no_import_cycle() -> None:
    graph = {_module_name(p): {m for m in _ckptmgr_imports(p) if m != _module_name(p)}
             for p in PKG.rglob("*.py")}
    # A package's __init__ re-exporting its modules is not a cycle with them.
    for name in graph:
        graph[name] = {m for m in graph[name] if not name.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_private_module_of_another_package() -> None:
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        me = _module_name(path)
        for mod in _ckptmgr_imports(path):
            parts = mod.split(".")
            private = [i for i, p in enumerate(parts) if p.startswith("_") and p != "__init__"]
            if not private:
                continue
            owner = ".".join(parts[:private[0]])  # the package the private module belongs to
            if not (me == owner or me.startswith(owner + ".")):
                problems.append(f"{me} imports {mod}, private to {owner}")
    assert not problems, "\n".join(problems)


# The one door for deletions (issue 25): everything ckptmgr removes under a root goes through
# StepStore._remove, which checks the writer lease first. These are the only other places that
# may remove anything, each with the reason it is not under a root's lease.
_REMOVERS = {"remove", "rm", "rm_file", "rmdir", "unlink", "rmtree", "removedirs", "delete"}
_DOORS = {
    ("step_store.py", "StepStore._remove"): "the door itself",
    ("lease.py", "Lease.release"): "the lease file itself, only while it still names this writer",
    ("integrations/lightning.py", "CkptmgrCheckpointIO.remove_checkpoint"):
        "a pointer file in the user's Lightning directory, asked for by Lightning",
    ("integrations/lightning.py", "_Run.drop_deleted"):
        "a pointer file this plugin wrote, once retention deleted its step (issue 31)",
    ("tools/export.py", "*"): "export's own temporary files in the user's output directory",
}


def _removals(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(enclosing Class.function, called name, line) of every call to a remover."""
    found: list[tuple[str, str, int]] = []

    def walk(node: ast.AST, where: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                walk(child, [*where, child.name])
                continue
            if isinstance(child, ast.Call):
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else (
                    f.id if isinstance(f, ast.Name) else None)
                if name in _REMOVERS:
                    found.append((".".join(where), name, child.lineno))
            walk(child, where)

    walk(tree, [])
    return found


def test_one_door_for_deletions() -> None:
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.startswith("storage/"):  # the Storage implementations' own remove()
            continue
        for where, name, line in _removals(ast.parse(path.read_text())):
            if (rel, where) in _DOORS or (rel, "*") in _DOORS:
                continue
            problems.append(f"{rel}:{line} {where}() calls {name}(): remove only through "
                            "StepStore._remove, which checks the writer lease first")
    assert not problems, "\n".join(problems)
