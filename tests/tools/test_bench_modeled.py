"""Every benchmark prints modeled_* columns beside the measured ones, also
on the CPU backend (--cpu smoke runs)."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks"


@pytest.mark.parametrize("script", ["bench_attention.py", "bench_mla.py", "bench_append.py", "bench_decode.py"])
def test_bench_prints_modeled_beside_measured(script):
    r = subprocess.run([sys.executable, str(BENCH / script), "--cpu"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "MODELED by cupaged.tools.perf_model" in out
    assert "modeled" in out.splitlines()[-1] or any("modeled" in ln for ln in out.splitlines()[-4:])
    # a modeled figure, not n/a, on this machine (NVRTC present in the test environment)
    assert "n/a" not in "".join(
        ln for ln in out.splitlines() if ln.strip().startswith(("decode", "prefill", "16", "2 "))
    )
