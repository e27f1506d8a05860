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
    # Two shards at once (the builds dominate: one a core); every family runs in one of them.
    shards = [
        subprocess.Popen(
            [sys.executable, str(HERE / "asan_sweep.py"), str(k), "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for k in range(2)
    ]
    done = 0
    for p in shards:
        out, err = p.communicate(timeout=600)
        assert "AddressSanitizer" not in err, err[-4000:]
        assert p.returncode == 0 and out.strip().endswith("done"), (out, err[-4000:])
        done += out.count("\nok ") + out.startswith("ok ")
    assert done == 25
