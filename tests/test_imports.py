"""Imports run one way: public concepts (plan, cache, graph) -> ops ->
runtime, with no cycle and no function-level import of our own modules."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cupaged"

# Layers, lowest first. A module may import its own layer or a lower one.
# (cupaged/__init__ re-exports everything; it is not a layer.)
LAYERS = [
    ("leaf", ["errors", "layout", "dtypes"]),
    ("runtime", ["_runtime"]),
    ("ops", ["ops"]),
    ("concepts", ["plan", "cache", "graph", "batch", "sampling"]),
    ("users", ["testing", "demo", "interop", "integrations", "tools", "engine", "__main__"]),
]


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        yield name, path


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None
    for i, (_, roots) in enumerate(LAYERS):
        if parts[1] in roots:
            return i
    if not (PACKAGE / parts[1]).exists() and not (PACKAGE / f"{parts[1]}.py").exists():
        return len(LAYERS) - 1  # a name the package root re-exports: as high as the root itself
    raise AssertionError(f"{module}: not in any layer of tests/test_imports.py")


def _imports(name: str, path: Path):
    """(imported module, line, at module level) of every import of cupaged code."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    top = {id(n) for n in tree.body}
    # imports inside `if TYPE_CHECKING:` or try at top level count as top level
    for n in tree.body:
        if isinstance(n, (ast.If, ast.Try)):
            top |= {id(x) for x in ast.walk(n)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "cupaged":
                continue
            targets = [f"{mod}.{a.name}" for a in node.names] if node.module is None or node.level else [mod]
            for t in targets:
                yield t, node.lineno, id(node) in top
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "cupaged":
                    yield a.name, node.lineno, id(node) in top


def test_imports_run_one_way():
    bad = []
    for name, path in _modules():
        src = _layer(name)
        if src is None:
            continue
        for target, line, top in _imports(name, path):
            if not top and LAYERS[src][0] != "users":
                bad.append(f"{path.name}:{line}: function-level import of {target}")
            dst = _layer(target)
            if dst is not None and dst > src:
                bad.append(f"{name} ({LAYERS[src][0]}) imports {target} ({LAYERS[dst][0]}), a higher layer")
    assert not bad, "\n".join(bad)


# One interpreter imports NumPy (a dependency, not ours), then forks a fresh
# child per module: each child starts with none of cupaged imported, so a
# cycle or an order dependence fails exactly as in a new interpreter, without
# ~70 interpreter starts (about 20 s of the suite's CPU time).
_FORK_EACH = """
import json, os, sys, traceback, importlib
import numpy  # noqa: F401 -- shared by every child
# Third-party packages the optional modules import at module level, imported once here (when installed) rather
# than once per child: vLLM's import alone is ~9 s of CPU. They import nothing of cupaged's.
for heavy in ("torch", "vllm.v1.attention.backend", "vllm.model_executor.layers.attention.mla_attention"):
    try:
        importlib.import_module(heavy)
    except ImportError:
        pass
assert not any(m == "cupaged" or m.startswith("cupaged.") for m in sys.modules), "a package imported cupaged"
out = {}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code, msg = 0, b""
        try:
            importlib.import_module(name)
        except BaseException:
            code, msg = 1, traceback.format_exc().encode()
        os.write(w, msg[-2000:])
        os._exit(code)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    out[name] = [os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace")]
print(json.dumps(out))
"""
_ALONE = [n for n, _ in _modules() if not n.endswith("__main__")]
#: Modules that import an optional package at module level: skipped with the reason without it.
_NEEDS = {"cupaged.integrations.vllm.backend": "vllm", "cupaged.integrations.vllm.mla": "vllm"}


@pytest.fixture(scope="module")
def imported_alone():
    """{module: (exit status, traceback)} of importing each module first in a fresh process."""
    if not hasattr(os, "fork"):  # one interpreter per module where fork is missing
        return {
            m: (r.returncode, r.stderr[-2000:])
            for m in _ALONE
            for r in [
                subprocess.run(
                    [sys.executable, "-c", f"import {m}"], capture_output=True, text=True, cwd=str(PACKAGE.parent)
                )
            ]
        }
    r = subprocess.run(
        [sys.executable, "-c", _FORK_EACH, *_ALONE], capture_output=True, text=True, cwd=str(PACKAGE.parent)
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return {m: tuple(v) for m, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("module", _ALONE)
def test_each_module_imports_alone(module, imported_alone):
    """Each module imports first in a fresh process (a cycle would fail)."""
    need = _NEEDS.get(module)
    if need and importlib.util.find_spec(need) is None:
        pytest.skip(f"{module} needs {need} (the vllm extra), not installed")
    code, err = imported_alone[module]
    assert code == 0, err


def test_import_is_light():
    """``import cupaged`` loads neither ml_dtypes (~1 s; imported when a
    bfloat16 / fp8 dtype is first needed), torch, CuPy, cuda-python nor
    transformers, and its own part (NumPy already imported: NumPy's ~0.1 s
    is not ours) takes at most 0.3 s: CPU time in a fresh interpreter, the
    fastest of five (0.13-0.22 s measured on this 2-core machine, idle to
    fully loaded by the suite's two workers; ml_dtypes alone adds ~1 s)."""
    code = (
        "import sys, time, numpy; t = time.process_time(); import cupaged; dt = time.process_time() - t; "
        "heavy = [m for m in ('ml_dtypes', 'torch', 'cupy', 'cuda.bindings', 'transformers') if m in sys.modules]; "
        "print(dt, ','.join(heavy))"
    )
    runs = []
    for _ in range(5):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
        ).stdout.split()
        assert len(out) == 1, f"import cupaged loaded {out[1]}"
        runs.append(float(out[0]))
    assert min(runs) <= 0.3, runs


def test_dtype_table_itemsizes_match_numpy():
    """The table's item sizes (known without importing ml_dtypes) are the
    NumPy dtypes' own."""
    from cupaged import dtypes

    for d in dtypes.TABLE:
        assert d.itemsize == d.np_dtype.itemsize and d.np_dtype.name == d.name, d
