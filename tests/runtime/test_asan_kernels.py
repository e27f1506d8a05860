"""Every kernel family under AddressSanitizer on padded and absurd device
metadata (tests/runtime/asan_sweep.py): no read or write leaves its arrays."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _libasan():
    try:
        path = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.slow
def test_kernels_stay_inside_their_arrays_under_asan():
    lib = _libasan()
    if lib is None:
        pytest.skip("libasan not found (g++ -print-file-name=libasan.so)")
    env = dict(os.environ, CUPAGED_CPU_ASAN="1", LD_PRELOAD=lib, ASAN_OPTIONS="detect_leaks=0")
    r = subprocess.run([sys.executable, str(HERE / "asan_sweep.py")], capture_output=True, text=True, env=env,
                       timeout=600)
    assert "AddressSanitizer" not in r.stderr, r.stderr[-4000:]
    assert r.returncode == 0 and r.stdout.strip().endswith("done"), (r.stdout, r.stderr[-4000:])
    assert r.stdout.count("\nok ") + r.stdout.startswith("ok ") == 23, r.stdout
