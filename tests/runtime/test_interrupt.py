"""Ctrl-C during a long CPU-backend launch: SIGINT stops it within a second
with KeyboardInterrupt, and the process keeps working. And the one parser of
CUPAGED_CPU_WORKERS."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

LONG = r"""
import sys, time
import numpy as np
import cupaged
rng = np.random.default_rng(0)
Q, L, ps, d = 16384, 4096, 16, 64          # 16384 decode queries over one shared 4096-token history (tens of seconds)
k = rng.standard_normal((L // ps, ps, 1, d)).astype(np.float32)
table = np.tile(np.arange(L // ps), (Q, 1))
plan = cupaged.HostPlan.build(table, [L] * Q, [1] * Q, ps, L // ps).upload(k)
q = rng.standard_normal((Q, 1, d)).astype(np.float32)
out = np.zeros((Q, 1, d), np.float32)
small = cupaged.HostPlan.build(table[:2], [L, L], [1, 1], ps, L // ps).upload(k)
small.attention(q[:2], k, k, 0.125, out=out[:2])          # compile outside the timed part
print("started", flush=True)
t = time.perf_counter()
try:
    plan.attention(q, k, k, 0.125, out=out)
    print("finished without interruption", flush=True)
    sys.exit(3)
except KeyboardInterrupt as e:
    print(f"interrupted after {time.perf_counter() - t:.2f} s: {e}", flush=True)
o2 = np.zeros((2, 1, d), np.float32)
small.attention(q[:2], k, k, 0.125, out=o2)               # the pool still works
ref, _ = cupaged.testing.reference.paged_attention(q[:2], k, k, table[:2], [L, L], [1, 1], 0.125, True)
assert np.allclose(o2, ref, atol=1e-4), "wrong result after the interrupt"
print("usable", flush=True)
"""


def test_sigint_stops_a_long_launch():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen(
        [sys.executable, "-c", "import cupaged.testing\n" + LONG],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = p.stdout.readline()
        assert line.strip() == "started", (line, p.stderr.read() if p.poll() is not None else "")
        time.sleep(1.0)  # well inside the launch (it takes far longer)
        sent = time.perf_counter()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
        elapsed = time.perf_counter() - sent
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, (out, err[-2000:])
    assert "interrupted after" in out and "usable" in out, out
    assert elapsed < 5.0, f"the process took {elapsed:.1f} s to stop and finish after SIGINT"
    stop = float(out.split("interrupted after ")[1].split(" s")[0])
    assert stop < 3.0, out


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "2000"])
def test_cpu_workers_variable_has_one_parser(value):
    """A bad CUPAGED_CPU_WORKERS is one clear error wherever it is read
    (the runtime pool, choose_splits' device size), not a raw ValueError in
    one place and silence in the other."""
    code = (
        "import numpy as np, cupaged\n"
        "from cupaged import PagedAttentionError\n"
        "plan = cupaged.HostPlan.build([[0] * 64], [4096], [1], 64, 1)\n"
        "for f in (lambda: cupaged.choose_splits(plan, 8, like=np.zeros(1)),\n"
        "          lambda: cupaged.argmax_into(np.zeros((1, 4), np.float32), np.zeros(1, np.int64))):\n"
        "    try:\n"
        "        f()\n"
        "        print('no error')\n"
        "    except PagedAttentionError as e:\n"
        "        print('error:', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), CUPAGED_CPU_WORKERS=value)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 2, (r.stdout, r.stderr[-2000:])
    for line in lines:
        assert line == f"error: CUPAGED_CPU_WORKERS: expected an integer from 1 to 1024, got {value!r}", line


def test_cpu_workers_variable_sets_the_pool():
    code = "import cupaged._runtime.cpu as c; print(c.num_workers(), c.configured_workers())"
    env = dict(os.environ, PYTHONPATH=str(REPO), CUPAGED_CPU_WORKERS=" 3 ")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.stdout.split() == ["3", "3"], (r.stdout, r.stderr[-2000:])
