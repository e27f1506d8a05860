"""The CPU backend's shim and runtime: the CUDA semantics that kernels rely on.

Kernels live in tests/runtime/kernels/shim_kernels.cu and are compiled through
cupaged._runtime.cpu exactly like the package's own kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cupaged._runtime import cpu as _cpu
from cupaged._runtime import source as _source
from cupaged.errors import KernelError, PagedAttentionError

KERNELS = Path(__file__).parent / "kernels" / "shim_kernels.cu"
REPO = Path(__file__).resolve().parents[2]
FULL = 0xFFFFFFFF


@pytest.fixture(scope="module")
def mod():
    return _cpu.load_module(_source.assemble(KERNELS), "shim_kernels")


def run(mod, name, grid, block, *args, smem=0):
    grid = (grid, 1, 1) if isinstance(grid, int) else tuple(grid) + (1,) * (3 - len(grid))
    block = (block, 1, 1) if isinstance(block, int) else tuple(block) + (1,) * (3 - len(block))
    mod.get_function(name).bind(grid, block, smem, args)()


def line_of(marker: str) -> int:
    for i, line in enumerate(KERNELS.read_text().splitlines(), start=1):
        if f"// @{marker}" in line:
            return i
    raise AssertionError(marker)


def i32(x):
    return np.int32(x)


# ---- launch geometry and arguments -------------------------------------------------
@pytest.mark.parametrize("grid,block", [((3, 2, 2), (4, 3, 2)), ((2, 1, 1), (70, 1, 1)), ((1, 3, 1), (8, 1, 5))])
def test_geometry(mod, grid, block):
    nb, nt = np.prod(grid), np.prod(block)
    out = np.full((nb * nt, 12), -1, np.int32)
    run(mod, "geometry", grid, block, out)
    bz, by, bx, tz, ty, tx = np.meshgrid(
        *(np.arange(n) for n in (grid[2], grid[1], grid[0], block[2], block[1], block[0])), indexing="ij"
    )
    want = np.stack([tx, ty, tz, bx, by, bz] + [np.full_like(tx, v) for v in (*block, *grid)], -1).reshape(-1, 12)
    np.testing.assert_array_equal(out, want)


def test_argument_types(mod):
    out = np.zeros(7, np.float64)
    inp = np.array([1.5], np.float32)
    run(
        mod,
        "arg_types",
        1,
        32,
        out,
        inp,
        i32(-7),
        np.uint32(4000000000),
        np.int64(-(2**40)),
        np.uint64(2**63 + 2**12),
        np.float32(0.25),
        np.float64(1e300),
    )
    np.testing.assert_array_equal(out, [1.5, -7, 4000000000, -(2**40), float(2**63 + 2**12), 0.25, 1e300])


def test_argument_errors(mod):
    f = mod.get_function("arg_types")
    assert f.num_params == 8 and f.param_types[:3] == ("double*", "const float*", "int")
    out, inp = np.zeros(7), np.zeros(1, np.float32)
    good = [out, inp, i32(1), np.uint32(1), np.int64(1), np.uint64(1), np.float32(1), np.float64(1)]

    def bind(args, grid=(1, 1, 1), block=(32, 1, 1), smem=0):
        return f.bind(grid, block, smem, tuple(args))

    with pytest.raises(PagedAttentionError, match=r"takes 8 arguments .* got 7"):
        bind(good[:7])
    for i, bad, msg in [
        (2, 5, r"argument 2 .*\(int\).*Python int"),
        (6, 0.5, r"argument 6 .*Python float"),
        (2, True, r"argument 2 .*Python bool"),
        (2, np.float32(1), r"argument 2 .*4-byte integer"),
        (4, i32(1), r"argument 4 .*8-byte integer"),
        (7, np.float32(1), r"argument 7 .*8-byte float"),
        (0, i32(1), r"argument 0 .*NumPy array"),
        (1, 7, r"argument 1 .*expected a NumPy array .*Python int 7"),
        (2, inp, r"argument 2 .*got a NumPy array"),
        (1, [1.0], r"argument 1 .*got builtins.list"),
    ]:
        args = list(good)
        args[i] = bad
        with pytest.raises(PagedAttentionError, match=msg):
            bind(args)
    with pytest.raises(PagedAttentionError, match="1024 threads"):
        bind(good, block=(33, 32, 1))
    with pytest.raises(PagedAttentionError, match=r"block\.z"):
        bind(good, block=(1, 1, 65))
    with pytest.raises(PagedAttentionError, match=r"grid\.y"):
        bind(good, grid=(1, 65536, 1))
    with pytest.raises(PagedAttentionError, match="shared_mem"):
        bind(good, smem=227 * 1024 + 1)
    with pytest.raises(PagedAttentionError, match="expected one of"):
        mod.get_function("no_such_kernel")
    bind(good, grid=(1, 65535, 1), block=(1, 1, 64), smem=227 * 1024)  # the limits themselves are fine
    bind(good, grid=(0, 1, 1))()  # an empty grid runs nothing


# ---- warp collectives ------------------------------------------------------------
def shfl_reference(vals, mode, arg, width, mask):
    """PTX shfl.sync semantics for each participating lane (others -1);
    reading a lane outside the mask gives the reader's own value."""
    out = np.full(32, -1, np.int64)
    seg = 32 - width
    for lane in range(32):
        if not mask >> lane & 1:
            continue
        minl = lane & seg
        maxl = minl | (0 if mode == 1 else 31 & ~seg)
        if mode == 0:
            j, ok = minl | (arg & ~seg & 31), True
        elif mode == 1:
            j = lane - arg
            ok = j >= maxl
        elif mode == 2:
            j = lane + arg
            ok = j <= maxl
        else:
            j = lane ^ arg
            ok = j <= maxl
        if not ok or not mask >> j & 1:
            j = lane
        out[lane] = vals[j]
    return out


SHFL_CASES = [
    (mode, arg, width, mask)
    for mode, arg in [
        (0, 0),
        (0, 5),
        (0, 37),
        (0, -1),
        (1, 1),
        (1, 3),
        (1, 16),
        (2, 1),
        (2, 2),
        (2, 9),
        (3, 1),
        (3, 6),
        (3, 16),
        (3, 31),
    ]
    for width in (32, 16, 8, 4, 1)
    for mask in (FULL, 0x0000FFFF)
]


def test_shuffles(mod):
    rng = np.random.default_rng(0)
    vals = rng.integers(-1000, 1000, 64).astype(np.int32)
    for mode, arg, width, mask in SHFL_CASES:
        out = np.zeros(64, np.int32)
        run(mod, "shfl_int", 1, 64, vals, out, i32(mode), i32(arg), i32(width), np.uint32(mask))
        for w in range(2):
            want = shfl_reference(vals[32 * w : 32 * w + 32], mode, arg, width, mask)
            np.testing.assert_array_equal(out[32 * w : 32 * w + 32], want, err_msg=f"{mode=} {arg=} {width=} {mask=:x}")


def test_shuffle_value_types(mod):
    rng = np.random.default_rng(1)
    n = 64
    f = rng.standard_normal(n).astype(np.float32)
    d = rng.standard_normal(n)
    u = rng.integers(0, 2**64, n, dtype=np.uint64)
    fo, do, uo = np.zeros(n, np.float32), np.zeros(n), np.zeros(n, np.uint64)
    ho, bo = np.zeros(n, np.uint16), np.zeros(n, np.uint32)
    run(mod, "shfl_types", 1, n, f, d, u, fo, do, uo, ho, bo)
    lane = np.arange(n) % 32
    base = np.arange(n) - lane
    np.testing.assert_array_equal(fo, f[base + (lane ^ 5)])
    down = np.where(lane % 16 + 3 < 16, np.arange(n) + 3, np.arange(n))
    np.testing.assert_array_equal(do, d[down])
    up = np.where(lane >= 7, np.arange(n) - 7, np.arange(n))
    np.testing.assert_array_equal(uo, u[up])
    np.testing.assert_array_equal(ho, f.astype(np.float16).view(np.uint16)[base + 31 - lane])
    b = np.stack([f, -f], -1).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
    np.testing.assert_array_equal(bo, (b[:, 0] | b[:, 1] << 16)[base + (lane ^ 1)])


@pytest.mark.parametrize("mask", [FULL, 0x0F0F0F0F, 0xAAAAAAAA, 0x00000100, 0xFFFF0000])
def test_votes(mod, mask):
    rng = np.random.default_rng(mask % 1000)
    pred = rng.integers(0, 2, 64).astype(np.int32) * rng.integers(1, 5, 64).astype(np.int32)
    pred[32:] = 3  # second warp: all true
    ballot, anyv, allv, uni = (np.full(64, 77, dt) for dt in (np.uint32, np.int32, np.int32, np.uint32))
    run(mod, "votes", 1, 64, pred, ballot, anyv, allv, uni, np.uint32(mask))
    for w in range(2):
        p = pred[32 * w : 32 * w + 32] != 0
        bits = sum(1 << l for l in range(32) if mask >> l & 1 and p[l])
        lanes = [l for l in range(32) if mask >> l & 1]
        others = [l for l in range(32) if not mask >> l & 1]
        sl = slice(32 * w, 32 * w + 32)
        assert set(ballot[sl][lanes]) == {bits}
        assert set(anyv[sl][lanes]) == {int(bits != 0)}
        assert set(allv[sl][lanes]) == {int(bits == mask)}
        assert set(uni[sl][lanes]) == {int(bits in (0, mask))}
        assert set(ballot[sl][others]) <= {77}


def test_warp_reduce_match_activemask(mod):
    rng = np.random.default_rng(2)
    v = rng.integers(0, 2**31, 64).astype(np.uint32)
    v[5] = 2**31 + 12345  # negative as int for __reduce_max_sync(int)
    out = np.zeros((64, 8), np.uint32)
    pred = np.zeros(64, np.int32)
    run(mod, "warp_reduce_match", 1, 64, v, out, pred)
    for w in range(2):
        x = v[32 * w : 32 * w + 32]
        o = out[32 * w : 32 * w + 32]
        assert (o[:, 0] == np.uint32(x.astype(np.uint64).sum() % 2**32)).all()
        assert (o[:, 1] == x.min()).all()
        assert (o[:, 2] == np.uint32(x.view(np.int32).max())).all()
        assert (o[:, 3] == np.bitwise_and.reduce(x)).all() and (o[:, 4] == np.bitwise_or.reduce(x)).all()
        assert (o[:, 5] == np.bitwise_xor.reduce(x)).all()
        for l in range(32):
            assert o[l, 6] == sum(1 << k for k in range(32) if x[k] % 3 == x[l] % 3)
        assert (o[:24, 7] == 0x00FFFFFF).all()  # lanes 24-31 exited before __activemask
        assert (pred[32 * w : 32 * w + 32] == int(len(set(x % 3)) == 1)).all()


def test_syncwarp_rotate(mod):
    x = np.arange(64, dtype=np.int32) * 3
    out = np.zeros(64, np.int32)
    run(mod, "syncwarp_rotate", 1, 64, x, out)
    lane = np.arange(64) % 32
    np.testing.assert_array_equal(out, x[np.arange(64) - lane + (lane + 1) % 32])


def test_warp_sum_max(mod):
    x = np.random.default_rng(3).standard_normal(256).astype(np.float32)
    s, m = np.zeros_like(x), np.zeros_like(x)
    run(mod, "warp_sum_max", 2, 128, x, s, m)
    np.testing.assert_allclose(s, np.repeat(x.reshape(-1, 32).sum(1), 32), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(m, np.repeat(x.reshape(-1, 32).max(1), 32))


@pytest.mark.parametrize("n", [40, 70, 1, 33, 1024])
def test_partial_warps(mod, n):
    x = np.random.default_rng(n).standard_normal(3 * n).astype(np.float32)
    out = np.zeros(3, np.float32)
    run(mod, "block_sum_partial", 3, n, x, out)
    np.testing.assert_allclose(out, x.reshape(3, n).sum(1), rtol=1e-5, atol=1e-4)


def test_warp_collective_primitive(mod):
    x = np.arange(64, dtype=np.int32)
    out = np.zeros(64, np.int32)
    run(mod, "warp_collective", 1, 64, x, out, i32(1000))
    half = x.reshape(4, 16).sum(1)  # lanes 0-15 and 16-31 of each warp are separate groups
    np.testing.assert_array_equal(out, np.repeat(half, 16) + 1000)


# ---- barriers and shared memory ------------------------------------------------------------
@pytest.mark.parametrize("n", [40, 70, 96, 1024])
def test_early_exit_before_barrier(mod, n):
    x = np.arange(n, dtype=np.int32) + 1
    out = np.zeros(n, np.int32)
    run(mod, "early_exit", 1, n, x, out)
    t = np.arange(n)
    src = (t + 1) % n
    want = np.where(t % 3 == 0, -7, np.where(src % 3 == 0, -2, 2 * x[src]))
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("n", [32, 256, 1024])
def test_shared_memory_reductions(mod, n):
    nb = 37
    x = np.random.default_rng(n).standard_normal(nb * n).astype(np.float32)
    out_s, out_d, first4 = np.zeros(nb, np.float32), np.zeros(nb, np.float32), np.zeros(4, np.float32)
    run(mod, "reduce_static", nb, n, x, out_s)
    run(mod, "reduce_dynamic", nb, n, x, out_d, first4, smem=4 * n)
    want = x.astype(np.float64).reshape(nb, n).sum(1)
    np.testing.assert_allclose(out_s, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(out_d, want, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(first4, x[:4])


def test_dynamic_shared_at_namespace_scope(mod):
    out = np.zeros(5 * 96, np.int32)
    run(mod, "reverse_dynamic", 5, 96, out, smem=4 * 96)
    t = np.arange(96)
    np.testing.assert_array_equal(out.reshape(5, 96), np.arange(5)[:, None] * 1000 + 95 - t)


def test_barrier_ops(mod):
    for pred in ([1] * 100, [0] * 100, [0] * 99 + [5], [1] * 99 + [0]):
        p = np.array(pred, np.int32)
        out = np.zeros(3, np.int32)
        run(mod, "barrier_ops", 1, 100, p, out)
        np.testing.assert_array_equal(out, [np.count_nonzero(p), int(p.all()), int(p.any())])


# ---- atomics ---------------------------------------------------------------------------
def test_atomics_across_blocks(mod):
    nb, nt = 300, 128
    n = nb * nt
    ci, cu, cull = np.zeros(2, np.int32), np.zeros(1, np.uint32), np.zeros(1, np.uint64)
    cf, mx, umx, mn = np.zeros(1, np.float32), np.full(1, -5, np.int32), np.zeros(1, np.uint32), np.zeros(1, np.int32)
    cas, cd = np.zeros(1, np.uint32), np.zeros(1, np.float64)
    run(mod, "atomics", nb, nt, ci, cu, cull, cf, mx, umx, mn, cas, cd)
    g = np.arange(n, dtype=np.int64)
    assert ci.tolist() == [n, -2 * n]
    assert int(cu[0]) == int(g.sum()) % 2**32
    assert int(cull[0]) == (n << 33) % 2**64
    assert cf[0] == n and cd[0] == n / 2  # exact: integers below 2^24
    assert mx[0] == (g * 7919 % 100003).max() and umx[0] == n - 1 and mn[0] == -(n - 1)
    assert cas[0] == n


def test_blocks_run_on_the_launching_thread_too(mod):
    """A one-block launch runs on the launching thread alone (no worker
    thread woken: no futex round trip for a decode step's small launches);
    a launch of more blocks wakes the other workers once, and every block
    still runs exactly once."""
    rt = _cpu.runtime()
    before = rt.cupaged_rt_thread_wakes()
    out = np.full((32, 12), -1, np.int32)
    run(mod, "geometry", 1, 32, out)
    assert rt.cupaged_rt_thread_wakes() == before and (out[:, 0] == np.arange(32)).all()
    if _cpu.num_workers() < 2:
        pytest.skip("one CPU worker: every launch runs on the launching thread")
    nb = 64
    out = np.full((nb * 32, 12), -1, np.int32)
    run(mod, "geometry", nb, 32, out)
    assert rt.cupaged_rt_thread_wakes() == before + 1
    assert sorted(out[::32, 3].tolist()) == list(range(nb))


def test_polling_workers_run_every_block_and_sleep_after(mod):
    """With idle workers polling (CUPAGED_CPU_SPIN_US's default; the suite sets 0), back-to-back launches still
    run every block once, and after the spin the pool's threads sleep (no CPU used while idle)."""
    import time

    rt = _cpu.runtime()
    if _cpu.num_workers() < 2:
        pytest.skip("one CPU worker: every launch runs on the launching thread")
    rt.cupaged_rt_set_spin(_cpu.SPIN_US)
    try:
        for nb in (2, 64, 3, 200):
            out = np.full((nb * 32, 12), -1, np.int32)
            run(mod, "geometry", nb, 32, out)
            assert sorted(out[::32, 3].tolist()) == list(range(nb))
        time.sleep(0.05)  # past the spin: the threads are asleep now
        t0 = time.process_time()
        time.sleep(0.2)
        assert time.process_time() - t0 < 0.03, "worker threads kept polling after the spin"
    finally:
        rt.cupaged_rt_set_spin(_cpu.spin_us())


@pytest.mark.parametrize("raw", ["-1", "x", "2000000"])
def test_spin_variable_is_checked(monkeypatch, raw):
    monkeypatch.setenv("CUPAGED_CPU_SPIN_US", raw)
    with pytest.raises(PagedAttentionError, match="CUPAGED_CPU_SPIN_US: expected an integer from 0 to"):
        _cpu.spin_us()


# ---- fp16 / bf16 ----------------------------------------------------------------------------
def same_bits_or_both_nan(got_bits, want_bits, dtype):
    got_nan = np.isnan(got_bits.view(dtype).astype(np.float32))
    want_nan = np.isnan(want_bits.view(dtype).astype(np.float32))
    bad = (got_bits != want_bits) & ~(got_nan & want_nan)
    assert not bad.any(), (
        f"{bad.sum()} mismatches, e.g. input index {np.flatnonzero(bad)[:5]}: "
        f"got {got_bits[bad][:5]}, want {want_bits[bad][:5]}"
    )


def test_half_and_bf16_to_float_all_patterns(mod):
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    f, b = np.zeros(65536, np.float32), np.zeros(65536, np.float32)
    run(mod, "half_from_bits", 64, 256, bits, f, b, i32(65536))
    same_bits_or_both_nan(f.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32), np.float32)
    same_bits_or_both_nan(
        b.view(np.uint32), bits.view(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32), np.float32
    )


def float_patterns() -> np.ndarray:
    """Every 16-bit value's float32 image and the float32 patterns around
    each rounding boundary of fp16 and bf16 (ties, +-1 ulp), over all
    exponents and signs, plus random patterns."""
    rng = np.random.default_rng(4)
    hi = np.arange(65536, dtype=np.uint32) << 16  # every bf16 value and the high halves of everything
    pats = [hi]
    for low in (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000):
        pats.append(hi | low)
    # fp16 boundaries: the low 13 bits around the tie point, for every sign/exponent/upper-mantissa slice
    top = rng.integers(0, 2**19, 2**16, dtype=np.uint32) << 13
    for low in (0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF):
        pats.append(top | low)
    half_vals = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    pats += [
        half_vals,
        half_vals + 1,
        half_vals - 1,
        half_vals | 0x1000,
        (half_vals | 0x1000) + 1,
        (half_vals | 0x1000) - 1,
    ]
    pats.append(rng.integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32))
    pats.append(
        np.array(
            [
                0x7F800000,
                0xFF800000,
                0x7FC00000,
                0xFFC00001,
                0x7F800001,
                0x477FF000,
                0x477FEFFF,
                0x477FF001,
                0x33000000,
                0x33000001,
                0x32FFFFFF,
                0x7F7FFFFF,
                0x7F7F8000,
                0x00000001,
            ],
            np.uint32,
        )
    )
    return np.unique(np.concatenate(pats)).view(np.float32)


def test_float_to_half_and_bf16_rounding(mod):
    f = float_patterns()
    n = f.size
    assert n > 1_500_000
    outs = [np.zeros(n, np.uint16) for _ in range(6)]
    run(mod, "half_to_bits", 128, 256, f, *outs, i32(n))
    with np.errstate(over="ignore", invalid="ignore"):
        want_h = f.astype(np.float16).view(np.uint16)
        want_b = f.astype(ml_dtypes.bfloat16).view(np.uint16)
    for got in outs[0], outs[1], outs[4]:
        same_bits_or_both_nan(got, want_h, np.float16)
    for got in outs[2], outs[3], outs[5]:
        same_bits_or_both_nan(got, want_b, ml_dtypes.bfloat16)
    # NaN becomes the GPU's canonical NaN
    nan = np.isnan(f)
    assert nan.any() and (outs[0][nan] == 0x7FFF).all() and (outs[2][nan] == 0x7FFF).all()


def test_half_pairs(mod):
    f = np.random.default_rng(5).standard_normal(1000).astype(np.float32) * 100
    out = np.zeros((1000, 4), np.float32)
    run(mod, "half_pairs", 4, 256, f, out, i32(1000))
    pair = np.stack([f, -2 * f], -1)
    np.testing.assert_array_equal(out[:, :2], pair.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(out[:, 2:], pair.astype(ml_dtypes.bfloat16).astype(np.float32))


def round_exact(x: Fraction, frac_bits: int, emin: int, emax: int) -> float:
    """The exact rational x rounded to nearest-even in a binary format."""
    if x == 0:
        return 0.0
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    e += 1 if Fraction(2) ** e <= a / 2 else 0
    e -= 1 if Fraction(2) ** e > a else 0
    e = max(e, emin)
    q = a / Fraction(2) ** (e - frac_bits)  # in units of one ulp
    n = q.numerator // q.denominator
    r = q - n
    n += r > Fraction(1, 2) or (r == Fraction(1, 2) and n % 2 == 1)
    v = Fraction(n) * Fraction(2) ** (e - frac_bits)
    return float(np.copysign(np.inf if v >= Fraction(2) ** (emax + 1) else float(v), float(x)))


def test_half_arithmetic(mod):
    rng = np.random.default_rng(6)
    n = 200_000
    a, b, c = (rng.integers(0, 65536, n, dtype=np.uint32).astype(np.uint16) for _ in range(3))
    ho, bo = np.zeros((n, 4), np.uint16), np.zeros((n, 4), np.uint16)
    run(mod, "half_math", 64, 256, a, b, c, ho, bo, i32(n))
    with np.errstate(all="ignore"):
        for dt, got, frac_bits, emin, emax in ((np.float16, ho, 10, -14, 15), (ml_dtypes.bfloat16, bo, 7, -126, 127)):
            x, y, z = (v.view(dt).astype(np.float64) for v in (a, b, c))
            # + * / of 16-bit values: float64 then float32 keeps more than 2p+2 bits at each
            # step, so rounding those to 16 bits is the one correct rounding.
            for k, ref in enumerate((x + y, x * y, x / y)):
                same_bits_or_both_nan(got[:, k], ref.astype(np.float32).astype(dt).view(np.uint16), dt)
            # fma: exact rational reference (NumPy would round twice)
            for i in range(3000):
                if not (np.isfinite(x[i]) and np.isfinite(y[i]) and np.isfinite(z[i])):
                    continue
                want = round_exact(Fraction(x[i]) * Fraction(y[i]) + Fraction(z[i]), frac_bits, emin, emax)
                g = float(got[i, 3:4].view(dt)[0])
                assert g == want, (dt, x[i], y[i], z[i], g, want)


# ---- math, vectors, printf --------------------------------------------------------------------
def test_exp2_and_min_max(mod):
    """The shim's exp2 (vec4.cuh v4::exp2 on the CPU backend) within one ulp of float64's, exact at integers
    (subnormal ones too) and the special values, its four-wide form the same bits; fmaxf / fminf (inline
    compares) as IEEE fmax / fmin with glibc's answer for a NaN operand: the other one."""
    rng = np.random.default_rng(5)
    special = np.array([-np.inf, np.inf, np.nan, 0.0, -0.0, 1, -1, 127, 128, -126, -149, -149.5, -150, -151, 3.25])
    x = np.concatenate([special, rng.uniform(-160, 130, 20000), rng.uniform(-1, 1, 5000)]).astype(np.float32)
    y = np.concatenate([np.full(special.size, np.nan), rng.uniform(-50, 50, x.size - special.size)]).astype(np.float32)
    y[3], y[4] = -0.0, 0.0
    out = np.zeros((x.size, 5), np.float32)
    run(mod, "exp2_forms", (x.size + 255) // 256, 256, x, y, out, i32(x.size))
    with np.errstate(over="ignore"):
        want = np.exp2(x.astype(np.float64)).astype(np.float32)
    ulps = np.abs(out[:, 0].view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert np.all(ulps[~np.isnan(x)] <= 1), x[ulps > 1]
    assert np.mean(ulps) < 0.05
    exact = (x == np.round(x)) | ~np.isfinite(x)
    np.testing.assert_array_equal(out[exact, 0], want[exact])  # 0 at -inf and -150, inf from 128, NaN for NaN
    np.testing.assert_array_equal(out[:, 1].view(np.uint32), out[:, 0].view(np.uint32))
    libm = np.abs(out[:, 2].view(np.int32).astype(np.int64) - out[:, 0].view(np.int32).astype(np.int64))
    assert np.all(libm[~np.isnan(x)] <= 1)  # the kernels' scalar exp2f (libm's) within an ulp of it
    np.testing.assert_array_equal(out[:, 3], np.fmax(x, y))
    np.testing.assert_array_equal(out[:, 4], np.fmin(x, y))
    assert not np.signbit(out[3, 3]) and np.signbit(out[4, 3])  # fmaxf of +0 and -0 is its first operand (glibc)


def test_math_functions(mod):
    x = np.linspace(-3, 3, 301).astype(np.float32)
    out = np.zeros((301, 20), np.float32)
    run(mod, "math_funcs", 2, 256, x, out, i32(301))
    a = np.abs(x)
    with np.errstate(all="ignore"):
        want = [
            np.exp(x),
            np.exp(x),
            np.exp2(x),
            np.log(a + 1),
            np.log(a + 1),
            np.sqrt(a),
            1 / np.sqrt(a + 1),
            np.maximum(x, 0.25),
            np.minimum(x, 0.25),
            x * 3 + 1,
            x / 3,
            np.floor(x),
            np.ceil(x),
            np.sin(x),
            np.cos(x),
            a**1.5,
            np.tanh(x),
            -x,
            np.clip(np.trunc(x * 10), -7, 7),
            1 / (x + 10),
        ]
    np.testing.assert_allclose(out, np.stack(want, -1), rtol=2e-6, atol=2e-6)


def test_vectors(mod):
    x = np.arange(32 * 4, dtype=np.float32).reshape(32, 4) + 0.5
    out, iout, sizes = np.zeros_like(x), np.zeros((32, 2), np.int32), np.zeros(6, np.uint32)
    run(mod, "vectors", 1, 32, x, out, iout, sizes)
    np.testing.assert_array_equal(out, x[:, ::-1])
    np.testing.assert_array_equal(iout, x.reshape(64, 2)[1::2].astype(np.int32))
    assert sizes.tolist() == [16, 16, 8, 8, 4, 4]


def test_printf(mod, capfd):
    run(mod, "say_hello", 2, 32, i32(42))
    out = capfd.readouterr().out
    assert sorted(out.splitlines()) == sorted(f"hello 42 from thread {t} of block {b}" for b in (0, 1) for t in (0, 1))


# ---- errors ---------------------------------------------------------------------------------
def test_deadlock_split_barriers_reported_and_pool_reusable(mod):
    out = np.zeros(64, np.int32)
    with pytest.raises(KernelError) as e:
        run(mod, "deadlock_split", 1, 64, out)
    msg = str(e.value)
    assert "deadlock_split" in msg and "block (0,0,0)" in msg
    assert f"threads 0-31 at __syncthreads() shim_kernels.cu:{line_of('SPLIT_A')}" in msg
    assert f"threads 32-63 at __syncthreads() shim_kernels.cu:{line_of('SPLIT_B')}" in msg
    # the pool works again at once
    x, o = np.arange(256, dtype=np.float32), np.zeros(1, np.float32)
    run(mod, "reduce_static", 1, 256, x, o)
    assert o[0] == x.sum()


def test_deadlock_one_thread_skips(mod):
    with pytest.raises(KernelError) as e:
        run(mod, "deadlock_skip", (2, 1), 40, np.zeros(40, np.int32))
    msg = str(e.value)
    assert f"thread 5 at __syncthreads() shim_kernels.cu:{line_of('SKIP_B')}" in msg
    assert f"threads 0-4, 6-39 at __syncthreads() shim_kernels.cu:{line_of('SKIP_A')}" in msg


def test_deadlock_between_shuffle_and_barrier(mod):
    with pytest.raises(KernelError) as e:
        run(mod, "deadlock_shfl_vs_barrier", 1, 64, np.zeros(64, np.int32))
    msg = str(e.value)
    assert "deadlock" in msg
    assert f"thread 0 waits in __shfl_sync(mask 0xffffffff) shim_kernels.cu:{line_of('SHFL_WAIT')}" in msg
    assert f"threads 1-63 wait at __syncthreads() shim_kernels.cu:{line_of('BAR_WAIT')}" in msg


def test_lanes_in_different_collectives(mod):
    with pytest.raises(KernelError) as e:
        run(mod, "different_collectives", 1, 32, np.zeros(32, np.int32))
    msg = str(e.value)
    assert "different warp collectives" in msg
    assert f"lanes 0-15 in __ballot_sync(mask 0xffffffff) at shim_kernels.cu:{line_of('COLL_BALLOT')}" in msg
    assert f"lane 16 in __shfl_sync(mask 0xffffffff) at shim_kernels.cu:{line_of('COLL_SHFL')}" in msg


def test_mask_names_exited_lane(mod):
    out = np.zeros(32, np.int32)
    run(mod, "exited_lane", 1, 32, out, i32(-1))
    assert (out[1:] == 1).all()
    # lane 0 runs first and exits; lane 1 then names it in its mask
    with pytest.raises(
        KernelError,
        match=r"thread 1 \(warp 0\) called __shfl_xor_sync\(mask 0xffffffff\) at "
        r"common.cuh:\d+, but lane 0 of the mask already exited",
    ):
        run(mod, "exited_lane", 1, 32, out, i32(0))
    # lanes 0-30 wait in the shuffle when lane 31 exits
    with pytest.raises(
        KernelError,
        match=r"thread 31 \(warp 0, lane 31\) exited while lanes 0-30 in "
        r"__shfl_xor_sync\(mask 0xffffffff\) at common.cuh:\d+ wait for it",
    ):
        run(mod, "exited_lane", 1, 32, out, i32(31))


def test_bad_masks_and_widths(mod):
    out = np.zeros(32, np.int32)
    with pytest.raises(KernelError, match=r"thread 0 .*mask 0x0000fffe, which does not include its own lane"):
        run(mod, "bad_mask", 1, 32, out, i32(0))
    with pytest.raises(KernelError, match="width 24"):
        run(mod, "bad_mask", 1, 32, out, i32(1))


def test_trap_and_assert(mod):
    out = np.zeros(64, np.int32)
    with pytest.raises(
        KernelError,
        match=rf"trap_kernel' block \(0,0,0\): thread 17: __trap\(\) at "
        rf"shim_kernels.cu:{line_of('TRAP')}",
    ):
        run(mod, "trap_kernel", 1, 64, out, i32(17))
    with pytest.raises(
        KernelError,
        match=rf"block \(3,0,0\): thread 2: assertion failed: "
        rf"in\[blockIdx.x \* blockDim.x \+ threadIdx.x\] "
        rf">= 0 "
        rf"at shim_kernels.cu:{line_of('ASSERT')}",
    ):
        x = np.zeros(4 * 32, np.int32)
        x[3 * 32 + 2] = -1
        run(mod, "assert_kernel", 4, 32, x)
    run(mod, "trap_kernel", 1, 64, out, i32(-1))
    assert (out == 1).all()


def test_assert_with_cassert(tmp_path):
    text = '#include <cassert>\nextern "C" __global__ void k(int* x) {\n    assert(x[threadIdx.x] != 4);\n}\n'
    m = _cpu.load_module(_source.assemble(_write(tmp_path / "ca.cu", text)), "ca")
    x = np.arange(8, dtype=np.int32)
    with pytest.raises(KernelError, match=r"thread 4: assertion failed: x\[threadIdx.x\] != 4 at ca.cu:3"):
        m.get_function("k").bind((1, 1, 1), (8, 1, 1), 0, (x,))()


def test_many_blocks_with_one_failing(mod):
    # Errors in one block stop the launch; the other workers' blocks are fine to have run.
    x = np.zeros(1000 * 32, np.int32)
    x[777 * 32 + 9] = -1
    with pytest.raises(KernelError, match=r"block \(777,0,0\): thread 9"):
        run(mod, "assert_kernel", 1000, 32, x)


def run_python(code: str, env: dict | None = None, timeout=60) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=e, timeout=timeout
    )


def test_stack_overflow_crashes_cleanly(mod):
    # The module is in the disk cache already; the child only loads it.
    r = run_python(f"""
        import numpy as np
        from pathlib import Path
        from cupaged._runtime import cpu as _cpu, source as _source
        m = _cpu.load_module(_source.assemble(Path({str(KERNELS)!r})), "shim_kernels")
        out = np.zeros(64, np.int32)
        m.get_function("stack_overflow").bind((1, 1, 1), (64, 1, 1), 0, (out, np.int32(100000)))()
        print("survived")
        """)
    assert r.returncode != 0 and "survived" not in r.stdout
    assert "cupaged CPU backend: fiber stack overflow in kernel stack_overflow" in r.stderr, r.stderr
    # a shallow recursion is fine
    out = np.zeros(64, np.int32)
    run(mod, "stack_overflow", 1, 64, out, i32(50))


def test_fault_names_kernel_and_thread(mod):
    r = run_python(f"""
        import numpy as np
        from pathlib import Path
        from cupaged._runtime import cpu as _cpu, source as _source
        m = _cpu.load_module(_source.assemble(Path({str(KERNELS)!r})), "shim_kernels")
        m.get_function("null_deref").bind((1, 1, 1), (8, 1, 1), 0, (np.uint64(0),))()
        print("survived")
        """)
    assert r.returncode != 0 and "survived" not in r.stdout
    assert (
        "cupaged CPU backend: SIGSEGV (address 0x0) in kernel null_deref, block (0,0,0), thread (3,0,0)" in r.stderr
    ), r.stderr


def test_fork_and_threads(mod):
    # A forked child starts its own workers; launches from several Python threads are serialized.
    r = run_python(f"""
        import os, threading, numpy as np
        from pathlib import Path
        from cupaged._runtime import cpu as _cpu, source as _source
        m = _cpu.load_module(_source.assemble(Path({str(KERNELS)!r})), "shim_kernels")
        f = m.get_function("reduce_static")
        x = np.random.default_rng(0).standard_normal(64 * 256).astype(np.float32)
        want = x.reshape(64, 256).sum(1)
        def check():
            o = np.zeros(64, np.float32)
            f.bind((64, 1, 1), (256, 1, 1), 0, (x, o))()
            assert np.allclose(o, want, atol=1e-4)
        check()
        pid = os.fork()
        if pid == 0:
            check()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        errors = []
        def loop():
            try:
                for _ in range(20):
                    check()
            except Exception as e:
                errors.append(e)
        ts = [threading.Thread(target=loop) for _ in range(4)]
        for t in ts: t.start()
        for t in ts: t.join()
        assert not errors, errors
        print("ok")
        """)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_disk_cache_and_fresh_process(tmp_path):
    log = tmp_path / "cxx.log"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec g++ "$@"\n')
    wrapper.chmod(0o755)
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void add1(int* x) { x[threadIdx.x] += 1; }\n')
    code = f"""
        import numpy as np
        from pathlib import Path
        from cupaged._runtime import cpu as _cpu, source as _source
        m = _cpu.load_module(_source.assemble(Path({str(src)!r})), "k")
        x = np.arange(8, dtype=np.int32)
        m.get_function("add1").bind((1, 1, 1), (8, 1, 1), 0, (x,))()
        assert (x == np.arange(8) + 1).all()
        print(m.path)
        """
    env = {"CUPAGED_CACHE_DIR": str(tmp_path / "cache"), "CUPAGED_CXX": str(wrapper)}
    r1 = run_python(code, env)
    assert r1.returncode == 0, r1.stderr
    assert log.read_text().count("\n") >= 3  # --version, runtime, preprocess + module
    log.write_text("")
    r2 = run_python(code, env)
    assert r2.returncode == 0, r2.stderr
    assert log.read_text() == "" and r2.stdout == r1.stdout  # no compiler run at all
    so = Path(r1.stdout.strip())
    assert so.exists() and so.name.startswith("k-") and so.parent == tmp_path / "cache"
    # a changed source is a new library
    src.write_text(src.read_text() + "// changed\n")
    r3 = run_python(code, env)
    assert r3.returncode == 0, r3.stderr
    assert Path(r3.stdout.strip()) != so and so.exists()


def test_compile_error(tmp_path, monkeypatch):
    from cupaged.errors import CompileError

    bad = 'extern "C" __global__ void broken(int* x) { x[0] = undefined_name; }\n'
    with pytest.raises(CompileError, match="undefined_name"):
        _cpu.load_module(_source.assemble(_write(tmp_path / "bad.cu", bad)), "bad")


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


def test_kernels_behind_preprocessor_conditions(tmp_path):
    text = textwrap.dedent("""\
        #define DECLARE(name) extern "C" __global__ void name(int* x) { x[threadIdx.x] = 7; }
        DECLARE(made_by_macro)
        #if 0
        extern "C" __global__ void disabled(int* x) { x[0] = 1; }
        #endif
        """)
    m = _cpu.load_module(_source.assemble(_write(tmp_path / "cond.cu", text)), "cond")
    assert m.kernel_names == ("made_by_macro",)
    x = np.zeros(4, np.int32)
    m.get_function("made_by_macro").bind((1, 1, 1), (4, 1, 1), 0, (x,))()
    assert (x == 7).all()


def test_ucontext_fallback(tmp_path):
    r = run_python(
        f"""
        import numpy as np
        from pathlib import Path
        from cupaged._runtime import cpu as _cpu, source as _source
        m = _cpu.load_module(_source.assemble(Path({str(KERNELS)!r})), "shim_kernels")
        x = np.random.default_rng(0).standard_normal(5 * 256).astype(np.float32)
        o = np.zeros(5, np.float32)
        m.get_function("reduce_static").bind((5, 1, 1), (256, 1, 1), 0, (x, o))()
        assert np.allclose(o, x.reshape(5, 256).sum(1), atol=1e-4)
        s = np.zeros(256, np.float32)
        m.get_function("warp_sum_max").bind((2, 1, 1), (128, 1, 1), 0, (x[:256], s, np.zeros(256, np.float32)))()
        assert np.allclose(s, np.repeat(x[:256].reshape(8, 32).sum(1), 32), atol=1e-4)
        try:
            m.get_function("deadlock_split").bind((1, 1, 1), (64, 1, 1), 0, (np.zeros(64, np.int32),))()
        except Exception as e:
            print(type(e).__name__)
        """,
        {"CUPAGED_CPU_FIBERS": "ucontext"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "KernelError"


def test_workers_env(tmp_path):
    r = run_python(
        """
        from cupaged._runtime import cpu as _cpu
        print(_cpu.num_workers())
        """,
        {"CUPAGED_CPU_WORKERS": "3"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "3"


def _libasan() -> str | None:
    try:
        path = subprocess.run(["g++", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


def test_asan_mode(tmp_path):
    src = _write(
        tmp_path / "asan_k.cu",
        textwrap.dedent("""\
        extern "C" __global__ void mirror(const float* x, float* y) {
            __shared__ float s[64];
            s[threadIdx.x] = x[threadIdx.x];
            __syncthreads();
            float v = s[63 - threadIdx.x];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            y[threadIdx.x] = v;
        }
        extern "C" __global__ void boom(int* x) {
            if (threadIdx.x == 7) __trap();
            __syncthreads();
        }
        extern "C" __global__ void oob(const float* x, float* y) {
            y[threadIdx.x] = x[threadIdx.x + 1];
        }
        """),
    )
    code = f"""
        import numpy as np
        from pathlib import Path
        from cupaged._runtime import cpu as _cpu, source as _source
        from cupaged.errors import KernelError
        m = _cpu.load_module(_source.assemble(Path({str(src)!r})), "asan_k")
        x, y = np.arange(64, dtype=np.float32), np.zeros(64, np.float32)
        def mirror():
            m.get_function("mirror").bind((3, 1, 1), (64, 1, 1), 0, (x, y))()
            r = x[::-1]
            assert (y == r + r.reshape(32, 2)[:, ::-1].ravel()).all()
        mirror()
        try:
            m.get_function("boom").bind((1, 1, 1), (64, 1, 1), 0, (np.zeros(1, np.int32),))()
        except KernelError:
            pass
        mirror()  # fibers abandoned by the trap left poisoned frames: reused cleanly
        print("ok", flush=True)
        m.get_function("oob").bind((1, 1, 1), (64, 1, 1), 0, (x, y))()
        print("survived")
        """
    r = run_python(code, {"CUPAGED_CPU_ASAN": "1"})
    assert r.returncode != 0 and "LD_PRELOAD" in r.stderr  # libasan must come first
    lib = _libasan()
    if lib is None:
        pytest.skip("libasan not found (g++ -print-file-name=libasan.so)")
    r = run_python(code, {"CUPAGED_CPU_ASAN": "1", "LD_PRELOAD": lib, "ASAN_OPTIONS": "detect_leaks=0"}, timeout=120)
    assert r.stdout.split() == ["ok"], (r.stdout, r.stderr[-3000:])
    assert "AddressSanitizer: heap-buffer-overflow" in r.stderr and "asan_k.cu:14 in oob" in r.stderr, r.stderr[-3000:]
