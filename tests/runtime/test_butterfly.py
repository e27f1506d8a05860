"""kernels_cu/butterfly.cuh on the CPU backend: each helper is one warp collective there, and gives the bits of the
shuffle loop it stands for (run beside it, one collective a shuffle), and the float64 result within rounding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cupaged._runtime import cpu as _cpu
from cupaged._runtime import source as _source

KERNELS = Path(__file__).parent / "kernels" / "butterfly_kernels.cu"
N, HEADS, ELEMS = 6, 3, 4  # butterfly_kernels.cu's kN, kHeads, kElems
THREADS, BLOCKS = 64, 2


@pytest.fixture(scope="module")
def mod():
    return _cpu.load_module(_source.assemble(KERNELS), "butterfly_kernels")


def run(mod, name, *args):
    mod.get_function(name).bind((BLOCKS, 1, 1), (THREADS, 1, 1), 0, args)()


@pytest.mark.parametrize("lanes", [2, 8, 32])
def test_sum_is_the_shuffle_loop(mod, lanes):
    rng = np.random.default_rng(lanes)
    x = (rng.standard_normal((BLOCKS * THREADS, N)) * 10.0 ** rng.integers(-3, 4, (BLOCKS * THREADS, N))).astype(
        np.float32
    )
    x[5, 2] = np.inf  # an Inf reaches its group's sums, as a shuffle would carry it
    got, want = np.zeros_like(x), np.zeros_like(x)
    run(mod, f"sum_helper_{lanes}", x, got)
    run(mod, f"sum_shuffles_{lanes}", x, want)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    groups = x.astype(np.float64).reshape(-1, lanes, N).sum(1)
    ref = np.repeat(groups, lanes, axis=0)
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got[finite], ref[finite], rtol=1e-5, atol=1e-6 * lanes * np.abs(x[np.isfinite(x)]).max())
    assert np.isinf(got[~finite]).all() and (~finite).sum() == lanes  # only the Inf's group, one value each


@pytest.mark.parametrize("lanes", [1, 4, 16])
def test_merge_rows_is_the_shuffle_loop(mod, lanes):
    rng = np.random.default_rng(100 + lanes)
    rows = BLOCKS * THREADS
    m = rng.standard_normal((rows, HEADS)).astype(np.float32) * 4
    m[::7, 1] = -np.inf  # row groups that saw nothing
    m[:32, 2] = -np.inf  # a whole warp of them
    l = np.where(np.isinf(m), 0.0, rng.uniform(0.5, 3.0, (rows, HEADS))).astype(np.float32)
    acc = rng.standard_normal((rows, HEADS, ELEMS)).astype(np.float32)
    acc[np.isinf(m)] = 0.0
    outs = []
    for kind in ("helper", "shuffles"):
        mm, ll, aa = m.copy(), l.copy(), acc.copy()
        run(mod, f"merge_{kind}_{lanes}", mm, ll, aa)
        outs.append((mm, ll, aa))
    for got, want in zip(outs[0], outs[1]):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # float64: the states of each warp's lanes l, l + lanes, ... (one per group of `lanes`) merged into one
    mm, ll, aa = outs[0]
    for w in range(rows // 32):
        for first in range(lanes):
            idx = np.arange(w * 32 + first, (w + 1) * 32, lanes)
            m64, l64, a64 = m[idx].astype(np.float64), l[idx].astype(np.float64), acc[idx].astype(np.float64)
            top = m64.max(0)
            wt = np.where(np.isinf(m64), 0.0, np.exp2(m64 - np.where(np.isinf(top), 0.0, top)))
            for i in idx:
                np.testing.assert_array_equal(mm[i], top.astype(np.float32))
                np.testing.assert_allclose(ll[i], (l64 * wt).sum(0), rtol=1e-5)
                np.testing.assert_allclose(aa[i], (a64 * wt[:, :, None]).sum(0), rtol=1e-4, atol=1e-5)
