"""The CPU backend's on-disk library cache survives damage: a library
truncated by a crash or a full disk (dlopen of which dies with SIGBUS) or a
missing / wrong checksum is rebuilt, for kernel modules and the runtime."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cupaged._runtime import cpu as _cpu

REPO = Path(__file__).resolve().parents[2]

RUN = """
import numpy as np, cupaged
x = np.array([[1.0, 3.0, 2.0], [5.0, 4.0, 6.0]], np.float32)
out = np.zeros(2, np.int64)
cupaged.argmax_into(x, out)
assert out.tolist() == [1, 2], out
print("ok")
"""


def _run(cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUPAGED_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, env=env, timeout=600)


def _libs(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.so"))


def test_damaged_libraries_are_rebuilt(tmp_path):
    r = _run(tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
    libs = _libs(tmp_path)
    assert any(p.name.startswith("cupaged_rt-") for p in libs) and len(libs) >= 2
    for p in libs:
        assert p.with_name(p.name + ".sum").is_file()
    sizes = {p: p.stat().st_size for p in libs}
    assert all(_cpu._intact(p) for p in libs)

    # Two rounds, each library damaged a different way in each: every damage is seen by the runtime or a
    # module, each of them once in its bytes and once in its sum (one rebuild a round, not one a damage).
    damages = ("truncate", "bad sum", "no sum", "empty")
    for rnd in range(2):
        for i, p in enumerate(libs):
            damage = damages[(2 * rnd + i) % 4]
            s = p.with_name(p.name + ".sum")
            if damage == "truncate":
                with open(p, "r+b") as f:
                    f.truncate(p.stat().st_size // 3)
            elif damage == "bad sum":
                s.write_text("12 0123\n")
            elif damage == "no sum":
                s.unlink()
            else:
                p.write_bytes(b"")
        r = _run(tmp_path)
        assert r.returncode == 0 and "ok" in r.stdout, (rnd, r.returncode, r.stderr[-2000:])
        for p in libs:  # rebuilt in full, with a matching sum
            assert p.stat().st_size > sizes[p] // 2, (rnd, p.name)
            assert _cpu._intact(p), (rnd, p.name)


def test_the_precompiled_shim_is_kept_and_rebuilt_when_damaged(tmp_path):
    # g++ builds every module with the shim precompiled (cpu._shim_include): one .gch a flag set, beside the
    # libraries, checked like them; a damaged one is rebuilt before the next module build reads it
    if _cpu._is_clang(_cpu._compiler()[1]):
        pytest.skip("clang builds modules with the shim's text (no precompiled header)")
    r = _run(tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
    (gch,) = tmp_path.glob("cupaged_shim-*.h.gch")
    assert _cpu._intact(gch) and gch.with_suffix("").is_file()
    size = gch.stat().st_size
    for lib in _libs(tmp_path):
        if not lib.name.startswith("cupaged_rt-"):
            lib.unlink()  # the next run builds its module again
    with open(gch, "r+b") as f:
        f.truncate(size // 3)
    r = _run(tmp_path)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
    assert _cpu._intact(gch) and gch.stat().st_size > size // 2  # rebuilt in full (its bytes name the build folder)


def test_a_precompiled_shim_removed_meanwhile_is_built_again(tmp_path, monkeypatch):
    # in one process: the cache folder's precompiled shim deleted after use is found missing and built again
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path))
    flags = _cpu._module_flags()
    first = _cpu._shim_include(flags)
    if first.name == "cupaged_shim.h":
        pytest.skip("clang builds modules with the shim's text (no precompiled header)")
    assert first.parent == tmp_path and Path(f"{first}.gch").is_file()
    for p in tmp_path.glob("cupaged_shim-*"):
        p.unlink()
    again = _cpu._shim_include(flags)
    assert again == first and Path(f"{again}.gch").is_file() and _cpu._intact(Path(f"{again}.gch"))
