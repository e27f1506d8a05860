"""What a wheel holds: every Python package of cupaged/ and every kernel source file under kernels_cu/ (the .cu,
.cuh, the shim's and the host code's .h / .hpp / .cpp) is named by pyproject.toml's packages, package-dir and
package-data, so an installed cupaged compiles what a source tree does (a header left out fails only there)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="pyproject.toml is read with tomllib (Python 3.11+)")

REPO = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_python_package_is_listed():
    listed = set(_setuptools()["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "cupaged").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert found <= listed, sorted(found - listed)


def test_every_kernel_source_file_is_package_data():
    st = _setuptools()
    dirs = {REPO / d: pkg for pkg, d in st["package-dir"].items() if d.startswith("kernels_cu")}
    data = st["package-data"]
    missing = []
    for f in sorted((REPO / "kernels_cu").rglob("*")):
        if not f.is_file():
            continue
        pkg = dirs.get(f.parent)
        if pkg is None or pkg not in st["packages"]:
            missing.append(f"{f.relative_to(REPO)}: its folder is no package of the wheel")
        elif not any(fnmatch.fnmatch(f.name, g) for g in data.get(pkg, [])):
            missing.append(f"{f.relative_to(REPO)}: not in {pkg}'s package-data {data.get(pkg, [])}")
    assert not missing, "\n".join(missing)
